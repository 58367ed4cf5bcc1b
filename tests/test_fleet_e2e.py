"""The fleet end to end: real `visbatch worker` processes on real Redis and PostgreSQL, tiny model.

Nothing is mocked but the model weights (the tiny random model stands in for the hub).
"""

from __future__ import annotations

import time

import pytest

from tests.fleet_harness import DB_PASSWORD, Fleet
from tests.media import write_pdf, write_video

# Budget: ~55 s on a busy 2-core machine (2026-12-02, load 2): a fleet per test (a shared one
# would change them: one cancels before any worker runs, one kills its GPU worker), one killed
# mid-batch that waits out a 20 s visibility timeout (shortened for it: it is about redelivery).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.fleet,
    pytest.mark.usefixtures("redis_url"),
    pytest.mark.budget(120, reason="a fleet per test, one killed mid-batch (a 20 s visibility timeout)"),
]

PROMPTS = ["-p", "What is on this page?", "-p", "Is there a table? Answer yes or no."]


@pytest.fixture
def fleet(tmp_path, tiny_model_dir, postgres_url):
    f = Fleet(tmp_path, tiny_model_dir, postgres_url)
    yield f
    f.kill_all()  # what each test proves is proven: no warm shutdown to wait out (issue 20)
    f.close()


def _every_unit_answered_once(fleet: Fleet, job_id: str, prompts: int) -> None:
    per_unit = fleet.results_per_unit(job_id)
    assert per_unit, "the job has no units"
    bad = {u: p for u, p in per_unit.items() if p != list(range(prompts))}
    assert not bad, f"units without exactly one result per prompt: {bad}"


def test_two_workers_two_jobs(fleet, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "a.pdf", pages=3)
    write_pdf(inputs / "b.pdf", pages=2, text="Receipt 42.00 USD")
    write_video(inputs / "clip.mp4", seconds=3)
    other = write_pdf(tmp_path / "other.pdf", pages=2)
    fleet.start_worker("ingest")
    fleet.start_worker("encode,generate")
    job1 = fleet.submit(str(inputs), *PROMPTS, "--max-new-tokens", "8")
    job2 = fleet.submit(str(other), "-p", "Summarize.", "--max-new-tokens", "8")
    fleet.wait([job1, job2])
    assert fleet.status(job1) == "succeeded", fleet.logs()
    assert fleet.status(job2) == "succeeded", fleet.logs()
    _every_unit_answered_once(fleet, job1, 2)
    _every_unit_answered_once(fleet, job2, 1)
    assert len(fleet.results_per_unit(job1)) == 3 + 2 + 3
    assert DB_PASSWORD not in fleet.logs(tail=10**7)


@pytest.mark.faults
def test_generate_worker_killed_mid_batch(fleet, tmp_path):
    """SIGKILL during generation: the batch's messages were not acked, another worker redoes them;
    upserts keep one result per unit and prompt, and the job still closes."""
    pdf = write_pdf(tmp_path / "long.pdf", pages=8)
    # One request per batch: results land one by one, so the kill falls between two of them.
    fleet.set(max_batch_size="1", visibility_timeout="20", task_time_limit="15")
    fleet.start_worker("ingest")
    gpu = fleet.start_worker("encode,generate")
    job = fleet.submit(str(pdf), *PROMPTS, "--max-new-tokens", "32", "--longest-side", "640")
    total = 8 * 2
    deadline = time.monotonic() + 300
    while not 0 < fleet.result_count(job) < total:
        assert time.monotonic() < deadline, fleet.logs()
        assert fleet.result_count(job) < total, "finished before the kill: make the batch slower"
        time.sleep(0.05)
    fleet.kill(gpu)
    assert fleet.status(job) == "running"
    fleet.start_worker("encode,generate")
    fleet.wait([job], timeout=240)
    assert fleet.status(job) == "succeeded", fleet.logs()
    _every_unit_answered_once(fleet, job, 2)


def test_cancelled_job_does_no_more_work(fleet, tmp_path):
    import redis

    from tests.fleet_harness import REDIS_URL

    pdf = write_pdf(tmp_path / "doc.pdf", pages=2)
    job = fleet.submit(str(pdf), "-p", "Hi", "--max-new-tokens", "4")
    cancel = fleet.run_cli("cancel", job)
    assert "cancelled" in cancel
    fleet.start_worker("ingest,encode,generate")
    client = redis.Redis.from_url(REDIS_URL)
    deadline = time.monotonic() + 120
    # The event: the worker says it skipped the job's ingest task (and acknowledged it).
    while "'skipped: job finished'" not in fleet.logs(tail=10**6):
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.2)
    assert client.llen(f"{fleet.prefix}ingest") == 0
    assert fleet.status(job) == "cancelled"
    assert fleet.results_per_unit(job) == {}
