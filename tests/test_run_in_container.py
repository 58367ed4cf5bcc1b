"""A run in a container is alive by its lease, not by a pid (issue 32, item 1).

A container runs `visbatch run` as pid 1 of its own PID namespace, under a host name that other
containers (host networking) share. Here that is `unshare --pid --uts` (as root, as in CI) on the
tiny model and real SQLite: seen from outside, the live run is `running`, and `visbatch resume`
refuses it at once (exit 2, where it runs and when it renewed its lease) and touches nothing; once
the container is killed, the job is `interrupted` within the lease and resume finishes it, every
page answered once.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.media import write_slow_pdf
from tests.test_first_hour import VISBATCH, _env, visbatch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.signals,
    pytest.mark.budget(
        150, reason="a run in a PID namespace, status/jobs/resume beside it, a resume to the end"
    ),
]

LEASE_S = "3"  # the shortest lease: the killed run's job is interrupted within seconds


def _unshare_or_skip() -> list[str]:
    command = ["unshare", "--pid", "--uts", "--fork", "--mount-proc", "--kill-child"]
    probe = subprocess.run([*command, "true"], capture_output=True, text=True, check=False)
    if shutil.which("unshare") is None or probe.returncode != 0:
        reason = f"no PID namespaces here (unshare: {probe.stderr.strip() or 'missing'}); CI runs as root"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return command


def _count(home: Path, sql: str, job: str) -> int:
    with sqlite3.connect(home / "visbatch.db", timeout=10) as db:
        return int(db.execute(sql, (job,)).fetchone()[0])


def _wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_a_live_run_in_another_pid_namespace_is_running_and_not_taken_over(tmp_path, tiny_model_dir):
    unshare = _unshare_or_skip()
    home = tmp_path / "home"
    env = _env(
        home, VISBATCH_LEASE_S=LEASE_S, VISBATCH_MAX_BATCH_SIZE="1", VISBATCH_MODEL=str(tiny_model_dir)
    )
    pdf = write_slow_pdf(tmp_path / "slow.pdf", pages=40)
    container = subprocess.Popen(
        [*unshare, VISBATCH, "run", str(pdf), "-p", "Hi", "--max-new-tokens", "2", "--longest-side", "448"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert container.stdout is not None
        job = container.stdout.readline().strip()
        assert re.fullmatch(r"[0-9a-f]{32}", job), (job, container.stderr and container.stderr.read())
        pages = "SELECT count(*) FROM units WHERE job_id = ?"
        _wait_for(lambda: _count(home, pages, job) > 0, "a page split")
        recorded = _count(home, "SELECT count(*) FROM jobs WHERE id = ? AND process LIKE '%:1:%'", job)
        assert recorded == 1, "the run is pid 1 of its namespace"

        # Resume first, while the run surely works (the checks after take seconds each).
        before = _count(home, pages, job)
        assert container.poll() is None, "the run ended before the checks: make the PDF slower"
        refused = visbatch(env, "resume", job)
        assert refused.rc == 2, (refused.rc, refused.err)
        assert f"job {job} is running (pid 1 on {socket.gethostname()}" in refused.err, refused.err
        assert "renewed its lease" in refused.err and "model:" not in refused.err  # before the model
        assert container.poll() is None, "the live run goes on"
        assert _count(home, "SELECT count(*) FROM jobs WHERE id = ? AND status = 'running'", job) == 1
        assert _count(home, pages, job) >= before

        status = visbatch(env, "status", job)
        assert re.search(r"status\s+running", status.out), status.out
        assert "interrupted" not in status.out
        assert f"pid 1 on {socket.gethostname()}" in status.out, status.out
        listed = visbatch(env, "jobs")
        assert re.search(rf"{job[:8]}\S*\s+running", listed.out), listed.out
        assert container.poll() is None, "the run ended during the checks: make the PDF slower"

        # The container dies (pid 1 and every process in its namespace): interrupted within the lease.
        os.killpg(container.pid, signal.SIGKILL)
        container.wait(timeout=30)
        _wait_for(lambda: "interrupted" in visbatch(env, "status", job).out, "interrupted", timeout=30)
    finally:
        if container.poll() is None:
            os.killpg(container.pid, signal.SIGKILL)
            container.wait(timeout=30)

    resumed = visbatch(env, "resume", job)
    assert resumed.rc == 0, resumed.err
    assert _count(home, "SELECT count(*) FROM units WHERE job_id = ?", job) == 40
    answers = "SELECT count(*) FROM results WHERE job_id = ? AND error IS NULL"
    assert _count(home, answers, job) == 40  # each page once
    assert _count(home, "SELECT count(*) FROM jobs WHERE id = ? AND lease_holder IS NULL", job) == 1
