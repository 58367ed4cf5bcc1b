"""Settings: keyword arguments over VISBATCH_* over defaults, typed and bounded, with errors that
name the variable; and what a bad value looks like from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from visbatch.settings import DEFAULT_MODEL, SETTINGS, SecretStr, SettingError, Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("VISBATCH_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_defaults_then_environment_then_arguments(monkeypatch):
    assert Settings().token_budget == 16384 and Settings().model == DEFAULT_MODEL
    monkeypatch.setenv("VISBATCH_TOKEN_BUDGET", "4096")
    monkeypatch.setenv("VISBATCH_VLLM_ENFORCE_EAGER", "yes")
    monkeypatch.setenv("VISBATCH_LIMIT_MAX_VIDEO_SECONDS", "90")
    monkeypatch.setenv("VISBATCH_HOME", "elsewhere")
    monkeypatch.setenv("VISBATCH_DATABASE_URL", "")  # empty: unset, the default SQLite file
    settings = Settings()
    assert settings.token_budget == 4096 and settings.vllm_enforce_eager is True
    assert settings.limit_max_video_seconds == 90.0 and isinstance(settings.limit_max_video_seconds, float)
    assert settings.home == Path("elsewhere") and settings.database_url is None
    assert settings.sqlalchemy_url() == f"sqlite:///{Path('elsewhere').resolve() / 'visbatch.db'}"
    assert Settings(token_budget=512, home="here").token_budget == 512  # arguments win, converted
    assert Settings(home="here").home == Path("here")


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("VISBATCH_TOKEN_BUDGET", "lots", "VISBATCH_TOKEN_BUDGET='lots': not an integer"),
        ("VISBATCH_TOKEN_BUDGET", "0", "VISBATCH_TOKEN_BUDGET='0': must be >= 1"),
        ("VISBATCH_METRICS_PORT", "70000", "VISBATCH_METRICS_PORT='70000': must be >= 0 and <= 65535"),
        ("VISBATCH_VLLM_GPU_MEMORY_UTILIZATION", "0", "must be > 0 and <= 1"),
        ("VISBATCH_VLLM_ENFORCE_EAGER", "maybe", "not true or false"),
        ("VISBATCH_LLM_TIMEOUT_S", "soon", "not a number"),
    ],
)
def test_a_bad_value_names_its_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingError, match=message.replace("(", r"\(")):
        Settings()


def test_arguments_are_checked_like_the_environment():
    with pytest.raises(SettingError, match="token_budget=True: not an integer"):
        Settings(token_budget=True)
    with pytest.raises(SettingError, match="max_batch_size=0: must be >= 1"):
        Settings(max_batch_size=0)
    with pytest.raises(TypeError, match="unknown setting.*token_budgett"):
        Settings(token_budgett=1)  # a typo fails instead of being ignored


def test_the_api_key_never_shows(monkeypatch):
    monkeypatch.setenv("VISBATCH_LLM_API_KEY", "sk-secret-1234")
    settings = Settings()
    assert settings.llm_api_key == SecretStr("sk-secret-1234")
    assert settings.llm_api_key is not None and settings.llm_api_key.get_secret_value() == "sk-secret-1234"
    assert "sk-secret" not in repr(settings) and "sk-secret" not in str(settings.llm_api_key)


def test_the_recorded_model_is_used_unless_one_is_given(monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.json").write_text(json.dumps({"model": "/models/mine"}))
    recorded = Settings(home=home)
    assert (recorded.model, recorded.model_origin) == ("/models/mine", str(home.resolve() / "config.json"))
    monkeypatch.setenv("VISBATCH_MODEL", "Qwen/Qwen2-VL-7B-Instruct")
    assert (Settings(home=home).model, Settings(home=home).model_origin) == (
        "Qwen/Qwen2-VL-7B-Instruct",
        "VISBATCH_MODEL",
    )


def test_every_setting_is_declared_with_a_description_and_documented():
    root = Path(__file__).resolve().parents[1]
    docs = " ".join(path.read_text() for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    for name, declared in SETTINGS.items():
        assert declared.description, name
        assert f"`{declared.env}`" in docs, f"{declared.env} is in no page of docs/"


def test_a_bad_variable_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "VISBATCH_HOME": str(tmp_path / "home"), "VISBATCH_TOKEN_BUDGET": "lots"}
    done = subprocess.run(
        [sys.executable, "-c", "from worker.cli.main import app; app(prog_name='visbatch')", "jobs"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: VISBATCH_TOKEN_BUDGET='lots': not an integer",
        "fix: correct or unset that variable (docs/cli.md lists every setting)",
    ]
