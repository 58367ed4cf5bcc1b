"""A job whose process is gone is never shown `running` (issue 21, item 3).

An embedded run (`visbatch run`, `resume`, the Python API) records its process (host, pid, start
time) in the job row; `status` and `jobs` derive `interrupted` when that process is gone on this
host (the stored status stays), say they cannot tell for another host, and leave fleet jobs to the
stall watch. A second Ctrl-C still names the job and the resume command. The process test is a real
`visbatch` process on the tiny model and SQLite, stopped mid-job; it waits on rows, not sleeps (a
SIGKILLed run shown `interrupted`, then resumed: tests/test_streaming.py).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from storage import jobs
from storage.models import utcnow
from tests.media import write_slow_pdf
from tests.test_first_hour import VISBATCH, _env, visbatch
from visbatch.settings import Settings
from worker.drivers.job_activity import job_activity, parse_process, process_gone, shown_status, this_process

# Budget: a `visbatch run` on the tiny model stopped mid-job by a double SIGINT, ~12 status/jobs
# calls (the SIGKILL case with its resume is tests/test_streaming.py's, which checks status and jobs).
pytestmark = pytest.mark.budget(120, reason="a run stopped mid-job by a double SIGINT, status calls")

SETTINGS = Settings(stall_after_s=120)


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# The decision, on a database --------------------------------------------------------------------


def test_this_process_is_alive_and_an_ended_one_is_gone():
    host, pid, start = parse_process(this_process()) or ("", 0, "")
    assert (host, pid) == (socket.gethostname(), os.getpid())
    assert process_gone(host, pid, start) is False
    assert process_gone(host, _dead_pid(), "") is True
    assert process_gone("another-host.example", pid, start) is None  # cannot tell from here
    assert parse_process(None) is None and parse_process("garbage") is None


def test_a_reused_pid_is_not_taken_for_the_process():
    host, pid, start = parse_process(this_process()) or ("", 0, "")
    if not start:
        pytest.skip("no process start time on this platform")
    assert process_gone(host, pid, str(int(start) + 1) if start.isdigit() else start + "0") is True


def _embedded_job(db, process: str) -> str:
    started = jobs.start_job(db, {"prompts": ["Hi"], "model": "tiny"}, [("/data/a.pdf", None)])
    jobs.record_process(db, started.job_id, process)
    return started.job_id


def test_status_and_jobs_say_interrupted_when_the_process_is_gone(db):
    pid = _dead_pid()
    job_id = _embedded_job(db, f"{socket.gethostname()}:{pid}:")
    summary = jobs.job_summary(db, job_id)
    activity = job_activity(SETTINGS, summary)  # at once: no stall threshold to wait for
    assert activity is not None and activity["state"] == "interrupted"
    assert activity["message"] == (
        f"interrupted: the process that ran it (pid {pid} on {socket.gethostname()}) is gone; "
        f"continue it: visbatch resume {job_id}"
    )
    [item] = [item for item in jobs.list_jobs(db) if item["id"] == job_id]
    assert shown_status(item) == "interrupted"
    assert jobs.job_summary(db, job_id)["status"] == "running"  # derived, never stored


def test_a_live_process_keeps_its_job_running(db):
    job_id = _embedded_job(db, this_process())
    assert job_activity(SETTINGS, jobs.job_summary(db, job_id)) is None  # moving: its ETA stays
    [item] = [item for item in jobs.list_jobs(db) if item["id"] == job_id]
    assert shown_status(item) == "running"
    late = job_activity(SETTINGS, jobs.job_summary(db, job_id), now=utcnow() + timedelta(minutes=10))
    assert late is not None and late["state"] == "stalled"
    assert f"the process that runs it (pid {os.getpid()}) is alive" in late["message"]


def test_a_job_run_on_another_host_cannot_be_told(db):
    job_id = _embedded_job(db, "gpu-box-7:4242:99")
    activity = job_activity(SETTINGS, jobs.job_summary(db, job_id))
    assert activity is not None and activity["state"] == "elsewhere" and activity["eta"] is True
    assert activity["message"].startswith("running on gpu-box-7 (pid 4242)")
    [item] = [item for item in jobs.list_jobs(db) if item["id"] == job_id]
    assert shown_status(item) == "running"
    late = job_activity(SETTINGS, jobs.job_summary(db, job_id), now=utcnow() + timedelta(minutes=10))
    assert late is not None and late["state"] == "stalled"
    assert f"(pid 4242 on gpu-box-7) is gone, run visbatch resume {job_id}" in late["message"]


def test_fleet_jobs_are_left_to_the_stall_watch(db):
    started = jobs.start_job(
        db, {"prompts": ["Hi"], "model": "tiny"}, [("a.pdf", None)], {"a.pdf": "s3://in/a.pdf"}
    )
    jobs.record_process(db, started.job_id, f"{socket.gethostname()}:{_dead_pid()}:")
    activity = job_activity(
        SETTINGS, jobs.job_summary(db, started.job_id), consumers={"ingest": 1, "encode": 1, "generate": 1}
    )
    assert activity is None
    [item] = [item for item in jobs.list_jobs(db) if item["id"] == started.job_id]
    assert shown_status(item) == "running"


# Real processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_model_dir) -> Path:
    home = tmp_path_factory.mktemp("interrupted") / "home"
    assert visbatch(_env(home), "model", "use", str(tiny_model_dir)).rc == 0
    return home


def _start(home: Path, pdf: Path) -> tuple[subprocess.Popen, str]:
    env = _env(home, VISBATCH_MAX_BATCH_SIZE="1")
    proc = subprocess.Popen(
        [VISBATCH, "run", str(pdf), "-p", "Hi", "--max-new-tokens", "2", "--longest-side", "448"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test's signals reach this process only
    )
    assert proc.stdout is not None
    job = proc.stdout.readline().strip()  # before any work starts
    assert re.fullmatch(r"[0-9a-f]{32}", job), (job, proc.stderr and proc.stderr.read())
    return proc, job


def _wait_for_row(home: Path, job: str, table: str, timeout: float = 120) -> None:
    """Until the job has a row in `table` (a page split, an answer stored): the job is mid-work."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sqlite3.connect(home / "visbatch.db", timeout=10) as db:
            if db.execute(f"SELECT 1 FROM {table} WHERE job_id = ? LIMIT 1", (job,)).fetchone():  # noqa: S608
                return
        time.sleep(0.05)
    raise AssertionError(f"no row in {table} for job {job} within {timeout} s")


@pytest.mark.slow
@pytest.mark.signals
def test_a_second_ctrl_c_still_names_the_job_and_the_resume_command(home, tmp_path):
    pdf = write_slow_pdf(tmp_path / "slow.pdf", pages=30)
    proc, job = _start(home, pdf)
    assert proc.stderr is not None
    _wait_for_row(home, job, "units")
    proc.send_signal(signal.SIGINT)
    seen = []
    for line in proc.stderr:  # the first one is heard: the run is stopping
        seen.append(line)
        if "press Ctrl-C again to leave at once" in line:
            break
    assert f"SIGINT (Ctrl-C): stopping job {job}, finished work is kept" in "".join(seen), seen
    proc.send_signal(signal.SIGINT)  # while the first one's cancel is under way
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert re.search(
        rf"stopped at once \(second SIGINT \(Ctrl-C\)\): job {job} (left unfinished|cancelled)", err
    ), err
    assert f"Resume with: visbatch resume {job}" in err, err
    # Cancelled when the database answered in time; else its process is gone: interrupted.
    status = visbatch(_env(home), "status", job)
    assert re.search(r"status\s+(cancelled|interrupted)", status.out), status.out
