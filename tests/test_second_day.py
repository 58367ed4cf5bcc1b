"""The second day of a user (issue 21): ordinary problems are never reported as bugs.

Real `visbatch` processes (exit codes and stderr are the behaviour), at 80 columns, in pipes, on
the tiny model and SQLite. One small job (a 1-page PDF and a 4-frame clip, 1 token an answer) is
shared by the tests that need answers.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.media import write_pdf, write_video
from tests.test_first_hour import VISBATCH, Done, _env, _error_lines, _job, visbatch

pytestmark = [pytest.mark.slow, pytest.mark.budget(120, reason="one tiny job, ~20 visbatch processes")]

Q1, Q2 = "What is on this page or frame?", "Is there a table?"


def _plain(done: Done, code: int) -> list[str]:
    """The error's lines, checked: the exit code, no "report it", no traceback."""
    assert done.rc == code, (done.rc, done.err)
    assert "unexpected" not in done.err and "report it" not in done.err, done.err
    assert "Traceback" not in done.err, done.err
    return _error_lines(done.err)


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_model_dir) -> Path:
    home = tmp_path_factory.mktemp("second-day") / "home"
    assert visbatch(_env(home), "model", "use", str(tiny_model_dir)).rc == 0
    return home


@pytest.fixture(scope="module")
def small_run(home, tmp_path_factory) -> Done:
    folder = tmp_path_factory.mktemp("inputs")
    write_pdf(folder / "invoice.pdf", pages=1)
    write_video(folder / "clip.mp4", seconds=4)  # sorts first: 4 frames before the invoice
    done = visbatch(_env(home), "run", str(folder), "-p", Q1, "-p", Q2, "--max-new-tokens", "1")
    assert done.rc == 0, done.err
    return done


def _closed_stdout(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`visbatch ARGS | head -0`: the reader is gone before the first line is written."""
    proc = subprocess.Popen([VISBATCH, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return subprocess.CompletedProcess(args, proc.wait(timeout=60), "", err)


# 1. a closed pipe ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["--format", "csv"], ["--format", "jsonl"]])
def test_a_closed_stdout_ends_results_quietly_with_0(home, small_run, args):
    done = _closed_stdout(_env(home), "results", _job(small_run), *args)
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr and "Broken" not in done.stderr and "Exception" not in done.stderr


@pytest.mark.parametrize("args", [["jobs"], ["status", "JOB"], ["status", "JOB", "--json"]])
def test_a_closed_stdout_ends_the_other_commands_quietly(home, small_run, args):
    done = _closed_stdout(_env(home), *[_job(small_run) if a == "JOB" else a for a in args])
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr and "Broken" not in done.stderr, done.stderr


# 2. paths and database URLs -------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["results", "JOB", "--format", "csv", "-o", "/etc/passwd/answers.csv"],
        ["results", "JOB", "--by-document", "/etc/passwd/answers"],
        ["view", "JOB", "--out", "/etc/passwd/review"],
    ],
)
def test_an_impossible_output_path_is_a_plain_usage_error(home, small_run, args):
    done = visbatch(_env(home), *[_job(small_run) if a == "JOB" else a for a in args])
    lines = _plain(done, 2)
    assert lines[0].startswith("error: /etc/passwd") and "not a directory" in lines[0], done.err
    assert lines[1].startswith("fix: ")


def test_an_output_in_a_missing_folder_names_the_folder(home, small_run, tmp_path):
    target = tmp_path / "no" / "such" / "answers.csv"
    done = visbatch(_env(home), "results", _job(small_run), "--format", "csv", "-o", str(target))
    lines = _plain(done, 2)
    assert lines[0] == f"error: {target}: the folder {tmp_path / 'no'} does not exist"


def test_ingest_into_a_path_under_a_file_is_a_usage_error(tmp_path):
    write_pdf(tmp_path / "a.pdf", pages=1)
    (tmp_path / "file").write_text("x")
    out = str(tmp_path / "file" / "out")
    done = visbatch(_env(tmp_path / "home"), "ingest", str(tmp_path / "a.pdf"), "--out", out)
    lines = _plain(done, 2)
    assert str(tmp_path / "file") in lines[0], done.err


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresl://me:secret-pw@127.0.0.1/test", "unknown database scheme 'postgresl'"),
        ("mysql://me@127.0.0.1/test", "needs the driver MySQLdb"),
        ("not a url", "not a database URL"),
    ],
)
def test_a_database_url_typo_names_the_variable_and_the_schemes(tmp_path, url, reason):
    done = visbatch(_env(tmp_path / "home", VISBATCH_DATABASE_URL=url), "jobs")
    lines = _plain(done, 2)
    assert len(lines) == 2, done.err
    assert lines[0].startswith("error: VISBATCH_DATABASE_URL") and reason in lines[0], done.err
    assert "sqlite:///" in lines[1] and "postgresql://" in lines[1]
    assert "secret-pw" not in done.err


# 3. cheap checks before the model -------------------------------------------------------------
def test_run_reports_a_database_down_before_loading_the_model(home, tmp_path, closed_port):
    write_pdf(tmp_path / "a.pdf", pages=1)
    url = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port}/test"
    done = visbatch(_env(home, VISBATCH_DATABASE_URL=url), "run", str(tmp_path / "a.pdf"), "-p", Q1)
    lines = _plain(done, 4)
    assert lines[0].startswith("error: cannot use the database"), done.err
    assert "model:" not in done.err  # the model was not even named, let alone loaded


def test_run_refuses_inputs_that_cannot_be_sources_before_loading_the_model(home, tmp_path):
    (tmp_path / "scan.pdf").write_bytes(b"this is no PDF at all")
    done = visbatch(_env(home), "run", str(tmp_path / "scan.pdf"), "-p", Q1)
    lines = _plain(done, 2)
    assert "scan.pdf: not a PDF" in lines[0] and "model:" not in done.err, done.err
    assert done.out == ""  # no job was made


def test_a_failed_job_does_not_advertise_answers(home, tmp_path):
    (tmp_path / "scan.pdf").write_bytes(b"%PDF-1.7\n" + b"\x00garbage" * 100)  # passes the cheap check
    done = visbatch(_env(home), "run", str(tmp_path / "scan.pdf"), "-p", Q1)
    assert done.rc == 3, done.err
    assert "all answers:" not in done.err and "no answers; every error: visbatch status" in done.err


# 4. view, compare and the Python API with the database down -------------------------------------
@pytest.mark.parametrize("command", [["view", "abcdef12"], ["compare", "abcdef12", "abcdef34"]])
def test_view_and_compare_with_the_database_down_exit_4(tmp_path, closed_port, command):
    url = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port}/test"
    done = visbatch(_env(tmp_path / "home", VISBATCH_DATABASE_URL=url), *command)
    lines = _plain(done, 4)
    assert len(lines) == 2 and lines[0].startswith("error: cannot use the database"), done.err
    assert "db upgrade" not in done.err


def test_the_python_api_raises_one_plain_exception_when_the_database_is_down(tmp_path, closed_port):
    url = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port}/test"
    code = (
        "import visbatch\n"
        "try:\n    visbatch.job('abcdef12')\n"
        "except visbatch.Unavailable as exc:\n"
        "    assert isinstance(exc, visbatch.Error) and exc.fix\n    print(exc)\n"
    )
    env = _env(tmp_path / "home", VISBATCH_DATABASE_URL=url)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("cannot use the database postgresql+psycopg://"), done.stdout
    bare = subprocess.run(
        [sys.executable, "-c", "import visbatch; visbatch.job('abcdef12')"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bare.returncode == 1 and len(bare.stderr.splitlines()) < 10, bare.stderr
    assert "sqlalchemy" not in bare.stderr.lower().replace("visbatch_database_url", "")


# 5. resume ----------------------------------------------------------------------------------------
def test_resume_names_where_the_model_came_from(home, small_run):
    job = _job(small_run)
    with sqlite3.connect(home / "visbatch.db") as db:  # as after a Ctrl-C
        db.execute("UPDATE jobs SET status = 'cancelled' WHERE id = ?", (job,))
    done = visbatch(_env(home), "resume", job)
    assert "(from --model)" not in done.err, done.err
    assert "(from the job's spec)" in done.err or "(from config.json)" in done.err, done.err


# 6. the preview -----------------------------------------------------------------------------------
def test_the_preview_shows_each_source(small_run):
    preview = small_run.err.split("first answers:", 1)[1]
    assert "clip.mp4 frame" in preview and "invoice.pdf page 1" in preview, small_run.err
    assert preview.count("clip.mp4") <= 4  # capped per source: 2 frames x 2 prompts


# The item 7: the end-of-run summary read at a glance -------------------------------------
def test_the_summary_says_each_thing_once(small_run):
    lines = small_run.err.splitlines()
    start = lines.index(f"job {_job(small_run)}")
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        rows.append(line.split()[0])
    # One tokens row (the pages' tokens and what the LM was given, side by side), no "tokens
    # saved" row when nothing was saved, the times on one row: 10 rows, not 15.
    assert rows.count("tokens") == 1 and "tokens saved" not in small_run.err, small_run.err
    assert rows.count("time") == 1 and "wall" not in rows and len(rows) <= 10, rows
    tokens = next(line for line in lines[start:] if line.strip().startswith("tokens "))
    assert "to the LM over all prompts" in tokens


# 7. ingest ------------------------------------------------------------------------------------------
def test_ingest_uses_the_folders_model_and_numbers_pages_from_1(home, tmp_path, tiny_model_dir):
    write_pdf(tmp_path / "a.pdf", pages=2)
    done = visbatch(_env(home), "ingest", str(tmp_path / "a.pdf"), "--out", str(tmp_path / "out"))
    assert done.rc == 0, done.err
    assert f"visual tokens counted for {tiny_model_dir}" in done.err, done.err
    records = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert [(r["unit"], r["page_number"]) for r in records] == [(0, 1), (1, 2)]
    assert all(r["visual_tokens"] for r in records)
