"""No torch where no tensor is touched: the CPU side never pays seconds and most of a gigabyte to
import torch and transformers. Each command runs in its own process, as a user runs it, and the
modules loaded by the end are checked."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.media import write_pdf

HEAVY = ("torch", "transformers")
# What a command that only reads the database (`status`, `jobs`, `results`) has no use
# for: the ORM, the job spec's pydantic models (and the commands they declare), pydantic itself
# (typer 0.29 coerces every parameter through it: +0.29 s; pyproject keeps typer below it),
# pydantic-settings,
# and, on SQLite, the PostgreSQL dialect and its driver; Alembic and the migration scripts (a
# reading command never migrates: one SELECT of the revision); the Runtime and the repository
# facade (the modules of claims, sources, units); and every library of another stage or
# service: the broker, S3, Redis, images, PDFs, video, arrays, Parquet, metrics, the hub. Each
# of these once cost `visbatch status` tens to hundreds of milliseconds (docs/performance.md).
NOT_FOR_READING = (
    "sqlalchemy.orm",
    "ingest.spec",
    "worker.cli.run",
    "pydantic",
    "pydantic_settings",
    "sqlalchemy.dialects.postgresql",
    "psycopg",
    "alembic",
    "migrations",
    "worker.runtime",
    "storage.repository",
    "celery",
    "kombu",
    "boto3",
    "redis",
    "PIL",
    "fitz",
    "av",
    "numpy",
    "pyarrow",
    "prometheus_client",
    "huggingface_hub",
)
# The command runs as `visbatch` would; however it ends (an exit, an error, a SIGTERM), the
# watched modules it loaded are printed last.
PROBE = f"""
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
from worker.cli.main import app
try:
    app()
except BaseException:
    pass
print('LOADED', sorted(m for m in {HEAVY + NOT_FOR_READING!r} if m in sys.modules))
"""


def _loaded_modules(env: dict[str, str], *args: str, stop_after: str | None = None) -> list[str]:
    """`stop_after`: a command that runs until stopped (watch) is sent SIGTERM once this text is in
    its log (stderr), i.e. once it has done what it does (an event, not a fixed sleep)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    early = ""
    if stop_after is not None:
        assert proc.stderr is not None
        guard = threading.Timer(180, proc.kill)  # never hang the suite on a command that says nothing
        guard.start()
        try:
            for line in proc.stderr:
                early += line
                if stop_after in line:
                    break
        finally:
            guard.cancel()
        assert stop_after in early, early
        proc.terminate()
    stdout, stderr = proc.communicate(timeout=180)
    stderr = early + stderr
    line = [x for x in stdout.splitlines() if x.startswith("LOADED ")]
    assert line, stdout + stderr
    return eval(line[-1].removeprefix("LOADED "))  # noqa: S307 - a list literal we printed ourselves


@pytest.fixture
def env(tmp_path, tiny_model_dir) -> dict[str, str]:
    return {
        **os.environ,
        "VISBATCH_HOME": str(tmp_path / "home"),
        "VISBATCH_MODEL": str(tiny_model_dir),
        # No broker here: `submit` stores its job, then fails to enqueue (after every import).
        "VISBATCH_BROKER_URL": "redis://127.0.0.1:1/0",
    }


@pytest.mark.parametrize(
    "args",
    [
        ["jobs"],
        ["status", "0123456789abcdef0123456789abcdef"],
        ["results", "0123456789abcdef0123456789abcdef"],
        ["cancel", "0123456789abcdef0123456789abcdef"],
        ["db", "upgrade"],
        ["plan", "{pdf}", "-p", "What is the total?"],
        ["ingest", "{pdf}", "--out", "{out}"],
        ["submit", "{pdf}", "-p", "hi"],
        ["watch", "s3://{bucket}/inbox/", "-p", "hi", "--poll-seconds", "0.1"],
    ],
    ids=lambda args: args[0] if args[0] != "db" else "db-upgrade",
)
def test_command_imports_neither_torch_nor_transformers(env, tmp_path, args, request):
    pdf = write_pdf(tmp_path / "doc.pdf", pages=1)
    bucket = request.getfixturevalue("s3_bucket") if args[0] == "watch" else ""
    filled = [a.format(pdf=pdf, out=tmp_path / "pages", bucket=bucket) for a in args]
    stop_after = None
    if args[0] == "watch":
        # The watcher on the test S3 server: stopped once its first poll has checked and marked
        # the inbox (every import a poll makes is done), not after a fixed sleep (issue 20).
        s3_server = request.getfixturevalue("s3_server")
        aws = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
        env = {**env, **aws, "VISBATCH_S3_ENDPOINT_URL": s3_server}
        stop_after = "checked and marked"
    assert [m for m in _loaded_modules(env, *filled, stop_after=stop_after) if m in HEAVY] == []


@pytest.mark.parametrize("command", ["status", "jobs", "results"])
def test_reading_commands_load_no_orm_no_job_spec(env, tiny_model_dir, command):
    """What keeps `visbatch status` near its floor (SQLAlchemy Core, typer): checked on a real
    job in the embedded SQLite database, the whole way (a database that is there, at the newest
    migration: the path every day's `status` takes)."""
    from storage.db import Database
    from storage.repository import create_job
    from visbatch.settings import Settings

    db = Database(Settings(home=Path(env["VISBATCH_HOME"])).sqlalchemy_url())
    db.upgrade()
    job = create_job(db, {"prompts": ["hi"]})
    args = [command] if command == "jobs" else [command, job]
    assert _loaded_modules(env, *args) == []


def test_the_splitting_child_imports_no_model_library_nor_sqlalchemy():
    code = (
        "import sys, ingest.child; "
        "print(sorted(m for m in ('torch', 'transformers', 'sqlalchemy') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.fleet
def test_an_ingest_worker_never_loads_torch(tmp_path, tiny_model_dir, postgres_url, redis_url):
    """A real `visbatch worker --queues ingest` ingests a job; neither it nor its pool processes map
    libtorch (read from /proc: what the processes really hold, not what Python says)."""
    import psutil

    from tests.fleet_harness import Fleet

    fleet = Fleet(tmp_path, tiny_model_dir, postgres_url)
    try:
        worker = fleet.start_worker("ingest")
        pdf = write_pdf(tmp_path / "doc.pdf", pages=3)
        job = fleet.submit(str(pdf), "-p", "hi")
        deadline = time.monotonic() + 180
        sql = "SELECT count(*) FROM sources WHERE job_id = :id AND status = 'ingested'"
        from sqlalchemy import text

        while True:
            with fleet.db.engine.connect() as conn:
                if conn.execute(text(sql), {"id": job}).scalar_one() == 1:
                    break
            assert time.monotonic() < deadline, fleet.logs()
            time.sleep(0.2)
        processes = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
        for proc in processes:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            assert "libtorch" not in maps, f"{proc.pid} {proc.cmdline()} maps libtorch"
    finally:
        fleet.close()
