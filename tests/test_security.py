"""Security rules that a code change could quietly break: no pickle, JSON-only Celery, bound SQL,
bounded schemas, secrets never in logs or output."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.spec import JobSpec
from visbatch.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [p for d in ("ingest", "storage", "worker") for p in (ROOT / d).rglob("*.py")]


def _calls(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                names.append(f"{func.value.id}.{func.attr}")
            elif isinstance(func, ast.Name):
                names.append(func.id)
    return names


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unsafe_deserialization(path):
    tree = ast.parse(path.read_text())
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {"pickle", "cPickle", "dill", "marshal", "shelve"} & (imports | modules)
    banned = {"torch.load", "pickle.loads", "pickle.load", "yaml.load", "eval", "exec", "os.system"}
    assert not banned & set(_calls(tree))


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_sql_is_never_built_from_strings(path):
    """text()/execute() only take constant SQL; values go in as bound parameters."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name in ("text", "execute", "exec_driver_sql") and node.args:
                first = node.args[0]
                assert not isinstance(first, ast.JoinedStr | ast.BinOp), f"{path}:{node.lineno}"


def test_celery_is_json_only():
    from worker.drivers.fleet.celery_app import make_celery

    app = make_celery(Settings())
    assert app.conf.accept_content == ["json"]
    assert app.conf.task_serializer == app.conf.result_serializer == "json"
    assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost


def test_visibility_timeout_must_exceed_time_limit():
    from worker.drivers.fleet.celery_app import make_celery

    with pytest.raises(ValueError, match="VISIBILITY_TIMEOUT"):
        make_celery(Settings(task_time_limit=600, visibility_timeout=600))


def test_schema_is_bounded():
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="deeper"):
        JobSpec(prompts=["x"], json_schema=deep)
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(ValueError, match="bytes"):
        JobSpec(prompts=["x"], json_schema=huge)


@pytest.mark.slow
def test_secrets_never_reach_logs_or_output(tmp_path, tiny_model_dir, postgres_url):
    """PostgreSQL trusts local connections, so a password in the URL is accepted and ignored:
    enough to check that neither it nor an S3 secret is ever printed, even with debug logs."""
    from sqlalchemy.engine import make_url

    from tests.media import write_pdf

    secret_pw, secret_key = "pw-Zq81-do-not-print", "aws-Kx55-do-not-print"
    url = make_url(postgres_url).set(password=secret_pw).render_as_string(hide_password=False)
    env = {
        **os.environ,
        "VISBATCH_HOME": str(tmp_path / "home"),
        "VISBATCH_MODEL": str(tiny_model_dir),
        "VISBATCH_DATABASE_URL": url,
        "AWS_SECRET_ACCESS_KEY": secret_key,
    }
    (tmp_path / "bad.pdf").write_text("not a pdf")
    write_pdf(tmp_path / "ok.pdf", pages=1)
    visbatch = str(Path(sys.executable).with_name("visbatch"))
    runs = [
        [visbatch, "-v", "run", str(tmp_path / "ok.pdf"), str(tmp_path / "bad.pdf"), "-p", "x",
         "--max-new-tokens", "2"],
        [visbatch, "jobs"],
        [visbatch, "status", "0123456789ab"],
    ]  # fmt: skip
    for argv in runs:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
        output = done.stdout + done.stderr
        assert secret_pw not in output and secret_key not in output, argv
