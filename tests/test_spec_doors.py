"""One validation of a job spec for every door: the CLI (run, submit, plan, watch --spec), the
Python API (JobSpec) and the drop folder (tests/test_dropfolder.py) check the same things and
say the same words. No service and no model needed: a spec is refused before either is touched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from ingest.spec import JobSpec, SpecError, describe_spec_error, schema_from_json, spec_from_json
from worker.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
VISBATCH = str(Path(sys.executable).with_name("visbatch"))
DEPTH_ERROR = "the JSON schema is nested deeper than 32 levels"


def _deep_text(depth: int) -> str:
    return '{"type": "object", "properties": {"x": ' * depth + "{}" + "}}" * depth


def _deep_dict(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _one_line(output: str) -> str:
    return " ".join(output.split())


@pytest.fixture
def deep_schema(tmp_path: Path) -> Path:
    path = tmp_path / "deep.json"
    path.write_text(_deep_text(5000))
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "s3://bucket/a.pdf", "-p", "Q?"],
        ["run", "missing.pdf", "-p", "Q?"],
        ["plan", "missing.pdf", "-p", "Q?"],
    ],
)
def test_a_5000_deep_schema_is_the_clean_limit_error(argv: list[str], deep_schema: Path) -> None:
    """Before: RecursionError out of json.loads, a traceback, exit 1."""
    result = CliRunner().invoke(app, [*argv, "--schema", str(deep_schema)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert f"invalid job spec: json_schema: {DEPTH_ERROR}" in _one_line(result.output)


def test_a_5000_deep_schema_in_a_real_process(deep_schema: Path, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "VISBATCH_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [VISBATCH, "submit", "s3://bucket/a.pdf", "-p", "Q?", "--schema", str(deep_schema)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # generous: a shared CI box can be slow to start Python
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.splitlines()  # one line, whatever the terminal width
    assert line == f"error: --schema {deep_schema}: invalid job spec: json_schema: {DEPTH_ERROR}"


def test_the_python_api_checks_the_schema_like_the_cli() -> None:
    """Before: JobSpec took any dict as a schema (the CLI alone compiled it), and a deep one raised
    RecursionError from the depth check itself."""
    with pytest.raises(ValidationError) as invalid:
        JobSpec(prompts=["Q?"], json_schema={"type": "nonsense", "properties": 5})
    assert describe_spec_error(invalid.value) == "json_schema: invalid JSON schema: 5 is not of type 'object'"
    with pytest.raises(ValidationError) as deep:
        JobSpec(prompts=["Q?"], json_schema=_deep_dict(5000))
    assert describe_spec_error(deep.value) == f"json_schema: {DEPTH_ERROR}"
    with pytest.raises(ValidationError, match="not plain JSON"):
        JobSpec(prompts=["Q?"], json_schema={"type": "object", "enum": {1, 2}})
    # What the grammar compiler cannot constrain is refused up front, not after the GPU ran.
    with pytest.raises(ValidationError, match="constrained decoding"):
        JobSpec(prompts=["Q?"], json_schema={"type": "string", "pattern": "(?=lookahead)"})
    spec = JobSpec(prompts=["Q?"], json_schema={"type": "object", "properties": {"a": {"type": "string"}}})
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec  # a worker rebuilds it


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompts": ["Q?"], "json_schema": {"type": "nonsense"}}, "json_schema: invalid JSON schema:"),
        ({"prompts": ["Q?"], "json_schema": _deep_dict(40)}, f"json_schema: {DEPTH_ERROR}"),
        ({"prompts": ["Q?"], "promts": ["typo"]}, "promts: unknown field (check its spelling)"),
        ({"prompts": ["Q?"], "sampling": {"max_new_tokens": 0}}, "sampling.max_new_tokens: Input should be"),
    ],
)
def test_watch_spec_file_and_spec_json_say_the_same(fields: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(SpecError) as python_door:
        spec_from_json(json.dumps(fields))
    assert str(python_door.value).startswith(f"invalid job spec: {message}")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(fields))
    result = CliRunner().invoke(app, ["watch", "s3://bucket/inbox/", "--spec", str(path)])
    assert result.exit_code == 2
    assert f"--spec {path}: {python_door.value}" in _one_line(result.output)


def test_json_problems_are_spec_errors() -> None:
    with pytest.raises(SpecError, match=r"not valid JSON \(Expecting .* line 1, column 2\)"):
        spec_from_json("{oops")
    with pytest.raises(SpecError, match="must be a JSON object"):
        spec_from_json("[1, 2]")
    with pytest.raises(SpecError, match="not UTF-8"):
        spec_from_json(b'{"prompts": ["\xff"]}')
    with pytest.raises(SpecError, match="nested deeper than 32 levels"):
        spec_from_json('{"prompts": ["Q?"], "json_schema": ' + _deep_text(5000) + "}")
    with pytest.raises(SpecError, match="over 65536 bytes"):
        schema_from_json(json.dumps({"enum": ["x" * 70_000]}))
