"""A full disk is waited out, not a failure (issue 32, item 3).

The page store on a real full filesystem (a tmpfs mounted here, as root in CI): `visbatch run`
retries the write, `visbatch status` says what it waits for, and once space is freed the job
finishes `succeeded` with every page, no resume needed (before, ENOSPC failed the source and the
job ended `partial`); the same with a fleet of real workers, whose tasks take that decision
through the one runner (tests/test_stage_runner.py runs a full disk past the tries under both
drivers).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.media import write_pdf
from tests.test_first_hour import VISBATCH, _env, visbatch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.budget(
        240, reason="a run, then a fleet of two workers, each waiting for space, then finishing"
    ),
]


def _fill(mount: Path) -> Path:
    """Every byte of the filesystem but a few: the next page image does not fit."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # unbuffered: every byte that fits
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real filesystem of its own (a tmpfs, as root: CI), unmounted after."""
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs here ({done.stderr.strip()}); CI runs as root"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _wait_for_waiting(status: Callable[[], str], timeout: float = 120) -> str:
    """Until `visbatch status` says the job waits for the disk (not, say, for a worker to start)."""
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        out = status()
        if "the disk is full" in out:
            return out
        time.sleep(0.5)
    raise AssertionError(f"status never said waiting:\n{out}")


def test_a_full_page_store_is_waited_out_and_the_job_finishes(tmp_path, tiny_model_dir, small_disk):
    mount = small_disk
    filler = _fill(mount)
    pdf = write_pdf(tmp_path / "doc.pdf", pages=4)
    env = _env(
        tmp_path / "home", VISBATCH_MODEL=str(tiny_model_dir), VISBATCH_STORE_URL=f"file://{mount}/store"
    )
    proc = subprocess.Popen(
        [VISBATCH, "run", str(pdf), "-p", "Hi", "--max-new-tokens", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        job = proc.stdout.readline().strip()
        assert re.fullmatch(r"[0-9a-f]{32}", job), job
        status = _wait_for_waiting(lambda: visbatch(env, "status", job).out)
        assert "waiting: ingest" in status and "the disk is full" in status, status
        assert re.search(r"status\s+running", status), status
        filler.unlink()  # the operator frees space
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "waiting: the disk is full" in err  # the run said it was waiting, not failing
    final = visbatch(env, "status", job).out
    assert re.search(r"status\s+succeeded", final), final
    assert re.search(r"answers\s+4 \(0 failed\)", final), final


@pytest.mark.fleet
def test_a_full_page_store_is_waited_out_by_the_fleet(tmp_path, tiny_model_dir, postgres_url, small_disk):
    # The job is submitted (its PDF uploaded to the store), then the disk fills, then the workers
    # start: the ingest worker's page writes meet ENOSPC, its task is retried (the wait handed to
    # the broker), and the job finishes once space is freed.
    from tests.fleet_harness import Fleet

    mount = small_disk
    fleet = Fleet(tmp_path, tiny_model_dir, postgres_url)
    fleet.set(store_url=f"file://{mount}/store")
    try:
        pdf = write_pdf(tmp_path / "doc.pdf", pages=3)
        job = fleet.submit(str(pdf), "-p", "Hi", "--max-new-tokens", "2")
        filler = _fill(mount)
        fleet.start_worker("ingest")
        fleet.start_worker("encode,generate")
        status = _wait_for_waiting(lambda: fleet.run_cli("status", job))
        assert "the disk is full" in status and re.search(r"status\s+running", status), status
        filler.unlink()
        fleet.wait([job], timeout=240)
        assert fleet.status(job) == "succeeded"
        assert list(fleet.results_per_unit(job).values()) == [[0], [0], [0]]  # each page once
    finally:
        fleet.kill_all()
        fleet.close()
