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
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from storage import jobs
from storage.leases import LeaseHeld, end_held, read_lease, release_lease, renew_lease, take_lease
from storage.models import JOBS, utcnow
from tests.media import write_slow_pdf
from tests.test_first_hour import VISBATCH, _env, visbatch
from visbatch.settings import Settings
from worker.drivers.job_activity import (
    Runner,
    job_activity,
    namespace_key,
    parse_process,
    process_gone,
    shown_status,
    this_process,
)
from worker.drivers.run_lease import refuse_if_alive

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


def _runner(process: str) -> Runner:
    runner = parse_process(process)
    assert runner is not None
    return runner


def test_this_process_is_alive_and_an_ended_one_is_gone():
    me = _runner(this_process())
    assert (me.host, me.pid, me.namespace) == (socket.gethostname(), os.getpid(), namespace_key())
    assert process_gone(me) is False
    assert process_gone(me._replace(pid=_dead_pid(), start="")) is True
    # Another machine, or a container under the same host name (its own PID namespace, where it
    # may well be pid 1): a pid there means nothing here.
    assert process_gone(me._replace(host="another-host.example", namespace="boot-2/4026531836")) is None
    assert process_gone(me._replace(pid=1, namespace=f"{namespace_key()}0")) is None
    assert process_gone(me._replace(namespace="")) is None  # a row of an older version
    assert parse_process(None) is None and parse_process("garbage") is None
    assert parse_process("host:12:34") == Runner("host", 12, "34", "")  # older rows still read


def test_a_reused_pid_is_not_taken_for_the_process():
    me = _runner(this_process())
    if not me.start:
        pytest.skip("no process start time on this platform")
    assert process_gone(me._replace(start=str(int(me.start) + 1) if me.start.isdigit() else me.start + "0"))


def _embedded_job(db, process: str, lease_s: float = 30.0) -> str:
    """A running job held by a run recorded as `process` (its lease taken as a run takes it)."""
    started = jobs.start_job(db, {"prompts": ["Hi"], "model": "tiny"}, [("/data/a.pdf", None)])
    assert take_lease(db, read_lease(db, started.job_id), uuid.uuid4().hex, process, lease_s)
    return started.job_id


def test_status_and_jobs_say_interrupted_when_the_process_is_gone(db):
    pid = _dead_pid()
    job_id = _embedded_job(db, f"{socket.gethostname()}:{pid}::{namespace_key()}")
    summary = jobs.job_summary(db, job_id)
    activity = job_activity(SETTINGS, summary)  # at once: its lease need not expire first
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
    assert (
        f"the process that runs it (pid {os.getpid()} on {socket.gethostname()}) is alive" in late["message"]
    )


def test_a_run_in_a_container_under_this_host_name_lives_by_its_lease(db):
    # Issue 32: pid 1 in its own PID namespace, under this host's name (a container with host
    # networking). Its pid 1 is not this host's: it is running while its lease is live...
    job_id = _embedded_job(db, f"{socket.gethostname()}:1:5:{namespace_key()}0")
    activity = job_activity(SETTINGS, jobs.job_summary(db, job_id))
    assert activity is not None and activity["state"] == "elsewhere" and activity["eta"] is True
    assert activity["message"].startswith(
        f"running in pid 1 on {socket.gethostname()}; lease renewed 0 s ago"
    )
    [item] = [item for item in jobs.list_jobs(db) if item["id"] == job_id]
    assert shown_status(item) == "running"
    with pytest.raises(LeaseHeld, match=rf"job {job_id} is running \(pid 1 on .*renewed its lease 0 s ago"):
        refuse_if_alive(read_lease(db, job_id))
    # ... and interrupted once the lease has expired (no renewal for 30 s), not before.
    late = job_activity(SETTINGS, jobs.job_summary(db, job_id), now=utcnow() + timedelta(seconds=31))
    assert late is not None and late["state"] == "interrupted"


def test_a_run_that_let_go_of_its_lease_unfinished_is_interrupted(db):
    holder = uuid.uuid4().hex
    started = jobs.start_job(db, {"prompts": ["Hi"], "model": "tiny"}, [("/data/a.pdf", None)])
    assert take_lease(db, read_lease(db, started.job_id), holder, "gpu-box-7:4242:99:boot/1", 30.0)
    release_lease(db, started.job_id, holder)
    [item] = [item for item in jobs.list_jobs(db) if item["id"] == started.job_id]
    assert shown_status(item) == "interrupted"
    refuse_if_alive(read_lease(db, started.job_id))  # may be taken over: no exception


def test_a_lease_is_taken_once_and_only_its_holder_ends_the_job(db):
    started = jobs.start_job(db, {"prompts": ["Hi"], "model": "tiny"}, [("/data/a.pdf", None)])
    seen = read_lease(db, started.job_id)
    assert take_lease(db, seen, "a" * 32, "h:1::x", 30.0)
    assert not take_lease(db, seen, "b" * 32, "h:2::x", 30.0)  # what b saw is no longer so
    assert not renew_lease(db, started.job_id, "b" * 32, 30.0)
    assert not end_held(db, started.job_id, "b" * 32, "cancelled", "b stops")  # never b's to end
    assert jobs.job_summary(db, started.job_id)["status"] == "running"
    assert end_held(db, started.job_id, "a" * 32, "cancelled", "a stops")
    assert jobs.job_summary(db, started.job_id)["status"] == "cancelled"


def test_a_row_of_an_older_version_elsewhere_cannot_be_told(db):
    started = jobs.start_job(db, {"prompts": ["Hi"], "model": "tiny"}, [("/data/a.pdf", None)])
    with db.session() as session:  # as 0006 recorded it: no namespace, no lease
        session.execute(update(JOBS).where(JOBS.c.id == started.job_id).values(process="gpu-box-7:4242:99"))
    late = job_activity(SETTINGS, jobs.job_summary(db, started.job_id), now=utcnow() + timedelta(minutes=10))
    assert late is not None and late["state"] == "stalled"
    assert f"if the process that ran it is gone, run visbatch resume {started.job_id}" in late["message"]


def test_fleet_jobs_are_left_to_the_stall_watch(db):
    started = jobs.start_job(
        db, {"prompts": ["Hi"], "model": "tiny"}, [("a.pdf", None)], {"a.pdf": "s3://in/a.pdf"}
    )
    with db.session() as session:
        process = f"{socket.gethostname()}:{_dead_pid()}::{namespace_key()}"
        session.execute(update(JOBS).where(JOBS.c.id == started.job_id).values(process=process))
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


@pytest.mark.slow
def test_a_run_that_lost_its_lease_stops_and_never_ends_the_job(settings_factory, tmp_path):
    # Issue 32: a process never cancels a job whose lease it does not hold. Another run took this
    # one over (as after a pause longer than the lease): this run stops at its next renewal and
    # writes no final status; the job stays the other run's, running.
    import threading

    from ingest.spec import JobSpec, Sampling
    from storage import repository as repo
    from storage.models import UnitStatus
    from tests.media import write_slow_pdf
    from worker.drivers.embedded import EmbeddedRun
    from worker.runtime import Runtime

    rt = Runtime(settings_factory(lease_s=3.0))
    run = EmbeddedRun(rt)
    pdf = write_slow_pdf(tmp_path / "slow.pdf", pages=12)
    taken = threading.Event()

    def take_over(job_id: str) -> None:
        def later() -> None:
            while not repo.units_in_state(rt.db, job_id, UnitStatus.PENDING) and not taken.is_set():
                time.sleep(0.05)
            with rt.db.session() as session:
                session.execute(update(JOBS).where(JOBS.c.id == job_id).values(lease_holder="b" * 32))
            taken.set()

        threading.Thread(target=later, daemon=True).start()

    spec = JobSpec(prompts=["Hi"], sampling=Sampling(max_new_tokens=2))
    started = time.monotonic()
    job_id = run.run([pdf], spec, on_job=take_over)
    assert taken.is_set() and run.lease.lost and time.monotonic() - started < 60
    assert run.stop_reason == f"another process took job {job_id} over"
    lease = read_lease(rt.db, job_id)
    assert lease.status == "running" and lease.holder == "b" * 32  # untouched: the other run's
