"""Faults injected for real into a running fleet (processes killed with SIGKILL, the broker
restarted, the database cut off), then the database is checked: every unit of the job has exactly
one result per prompt, and the job is closed. Loopback only; nothing shared is stopped."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from tests.faults import FlakyS3Proxy, RedisServer, TCPProxy
from tests.fleet_harness import Fleet
from tests.media import write_pdf, write_slow_pdf

# Budget: ~180-200 s beside another xdist worker (2026-12-02/03): a fleet per fault, and the kill
# tests wait out a 20 s visibility timeout (the fleet fixture's, shortened for them: they are about
# redelivery, not its delay). Once (2026-12-03) a killed encode worker's messages came back only
# after ~2 min instead of ~20 s (the module took 303 s); not yet explained, hence the headroom.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.fleet,
    pytest.mark.faults,
    pytest.mark.usefixtures("redis_url"),
    pytest.mark.budget(450, reason="a fleet per fault, a 20 s visibility timeout"),
]

PROMPTS = ["-p", "What is on this page?", "-p", "Any table?"]


def _scalar(fleet: Fleet, sql: str, **params: str) -> int:
    with fleet.db.engine.connect() as conn:
        return conn.execute(text(sql), params).scalar_one()


def _units(fleet: Fleet, job_id: str, status: str | None = None) -> int:
    sql = (
        "SELECT count(*) FROM units WHERE job_id = :id"
        " AND (CAST(:status AS TEXT) IS NULL OR status = :status)"
    )
    return _scalar(fleet, sql, id=job_id, status=status)


def _wait_until(condition: Callable[[], bool], fleet: Fleet, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.05)


def _exactly_once(fleet: Fleet, job_id: str, units: int, prompts: int = 2) -> None:
    assert fleet.status(job_id) == "succeeded", fleet.logs()
    per_unit = fleet.results_per_unit(job_id)
    assert len(per_unit) == units
    assert all(p == list(range(prompts)) for p in per_unit.values()), per_unit


@pytest.fixture
def fleet(tmp_path, tiny_model_dir, postgres_url):
    f = Fleet(tmp_path, tiny_model_dir, postgres_url)
    # Short limits so a task abandoned by a killed worker comes back within seconds.
    f.set(visibility_timeout="20", task_time_limit="15")
    yield f
    f.kill_all()  # what each test proves is proven: no warm shutdown to wait out
    f.close()


def _retried(fleet: Fleet) -> bool:
    """A worker has logged a retry after a transient error: a task's (worker.drivers.fleet.tasks.retrying,
    "...; retry 1") or a call's within it (worker.retry.RetryPolicy, "...; retrying in 1.3 s (1/8)")."""
    retry = r"; (retry \d+|retrying in [\d.]+ s \(\d+/\d+\))$"
    return bool(re.search(retry, fleet.logs(tail=10**7), re.MULTILINE))


def test_worker_killed_during_ingest(fleet, tmp_path):
    # Units are stored 64 at a time: kill once the first chunk is in, before the source is done.
    pdf = write_slow_pdf(tmp_path / "long.pdf", pages=100)
    ingest = fleet.start_worker("ingest")
    fleet.start_worker("encode,generate")
    job = fleet.submit(
        str(pdf), "-p", "What is on this page?", "--max-new-tokens", "1", "--longest-side", "448"
    )
    _wait_until(lambda: _units(fleet, job) > 0, fleet)
    fleet.kill(ingest)
    pending = "SELECT count(*) FROM sources WHERE job_id = :id AND status = 'pending'"
    assert _scalar(fleet, pending, id=job) == 1, "ingest finished before the kill"
    fleet.start_worker("ingest")
    fleet.wait([job], timeout=480)
    _exactly_once(fleet, job, 100, prompts=1)


def test_worker_killed_during_encode(fleet, tmp_path):
    pdf = write_pdf(tmp_path / "doc.pdf", pages=12)
    fleet.set(encode_chunk_units="1")
    fleet.start_worker("ingest")
    encode = fleet.start_worker("encode")
    fleet.start_worker("generate")
    job = fleet.submit(str(pdf), *PROMPTS, "--max-new-tokens", "2")
    _wait_until(lambda: _units(fleet, job) == 12 and _units(fleet, job, "pending") < 12, fleet)
    fleet.kill(encode)
    assert _units(fleet, job, "pending") > 0, "encode finished before the kill"
    fleet.start_worker("encode")
    fleet.wait([job])
    _exactly_once(fleet, job, 12)


def test_broker_restarted_during_a_job(fleet, tmp_path):
    broker = RedisServer(tmp_path / "broker")
    try:
        fleet.set(broker_url=broker.url)
        pdf = write_pdf(tmp_path / "doc.pdf", pages=8)
        fleet.start_worker("ingest")
        fleet.start_worker("encode,generate")
        fleet.set(max_batch_size="1")
        job = fleet.submit(str(pdf), *PROMPTS, "--max-new-tokens", "24", "--longest-side", "640")
        _wait_until(lambda: fleet.result_count(job) > 0, fleet)
        broker.restart(down_seconds=3)
        fleet.wait([job])
        _exactly_once(fleet, job, 8)
    finally:
        fleet.kill_all()
        fleet.close()
        broker.stop()


def test_database_unreachable_for_a_while(tmp_path, tiny_model_dir, postgres_url):
    """Workers reach PostgreSQL through a proxy that is cut mid-job until a task has failed with a
    connection error and been retried (its log line: an event, not the fixed 8 s it was, issue 20):
    tasks retry with backoff, and the job completes once it is back."""
    url = make_url(postgres_url)
    proxy = TCPProxy(url.port or 5432, url.host or "127.0.0.1")
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    fleet = Fleet(tmp_path, tiny_model_dir, postgres_url, worker_database_url=proxied)
    try:
        fleet.set(max_batch_size="1", encode_chunk_units="2")
        pdf = write_pdf(tmp_path / "doc.pdf", pages=8)
        fleet.start_worker("ingest")
        fleet.start_worker("encode,generate")
        job = fleet.submit(str(pdf), *PROMPTS, "--max-new-tokens", "24", "--longest-side", "640")
        _wait_until(lambda: fleet.result_count(job) > 0, fleet)
        proxy.cut()
        _wait_until(lambda: _retried(fleet), fleet, timeout=120)
        proxy.restore()
        fleet.wait([job])
        _exactly_once(fleet, job, 8)
    finally:
        fleet.kill_all()
        fleet.close()
        proxy.close()


def test_s3_throttling_and_cache_redis_down(tmp_path, tiny_model_dir, postgres_url, s3_server, s3_bucket,
                                            closed_port):  # fmt: skip
    """Images and cold tokens on S3 behind a proxy that throttles every 3rd request (503 SlowDown),
    and the hot cache Redis down: work goes on through S3 and the tower. A missing S3 object is a
    clear error on its source."""
    proxy = FlakyS3Proxy(s3_server, every=3)
    fleet = Fleet(tmp_path, tiny_model_dir, postgres_url)
    try:
        fleet.set(
            store_url=f"s3://{s3_bucket}/store",
            cache_url=f"redis://127.0.0.1:{closed_port}/0",
            cache_cold_url=f"s3://{s3_bucket}/cache",
            s3_endpoint_url=proxy.url,
        )
        fleet.env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                          "AWS_DEFAULT_REGION": "us-east-1"})  # fmt: skip
        pdf = write_pdf(tmp_path / "doc.pdf", pages=4)
        fleet.start_worker("ingest")
        fleet.start_worker("encode,generate")
        missing = f"s3://{s3_bucket}/inbox/no-such-file.pdf"
        job = fleet.submit(str(pdf), missing, *PROMPTS, "--max-new-tokens", "2")
        fleet.wait([job])
        assert fleet.status(job) == "partial", fleet.logs()
        per_unit = fleet.results_per_unit(job)
        assert len(per_unit) == 4 and all(p == [0, 1] for p in per_unit.values())
        error = _scalar(
            fleet, "SELECT error FROM sources WHERE job_id = :id AND uri = :uri", id=job, uri=missing
        )
        assert error == f"not found: {missing}"
        assert proxy.failures > 0
    finally:
        fleet.kill_all()
        fleet.close()
        proxy.close()


def test_s3_outage_during_encode_fails_no_page(tmp_path, tiny_model_dir, postgres_url, s3_server, s3_bucket):
    """The image store and the cold token cache (S3) cut once ingest is done and encoding starts,
    until a worker has retried after the connection errors (botocore's own retries spent: its log
    line, an event, not the fixed 20 s it was, issue 20): they are transient (storage.errors), so
    they are retried with backoff instead of failing pages; the job succeeds, every page answered."""
    port = int(s3_server.rsplit(":", 1)[1])
    proxy = TCPProxy(port)
    fleet = Fleet(tmp_path, tiny_model_dir, postgres_url)
    try:
        fleet.set(
            store_url=f"s3://{s3_bucket}/store",
            cache_cold_url=f"s3://{s3_bucket}/cache",
            cache_url="redis://127.0.0.1:1/0",  # no hot tier: every lookup goes to S3
            s3_endpoint_url=f"http://127.0.0.1:{proxy.port}",
        )
        fleet.env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                          "AWS_DEFAULT_REGION": "us-east-1"})  # fmt: skip
        pdf = write_pdf(tmp_path / "doc.pdf", pages=8)
        fleet.start_worker("ingest")
        job = fleet.submit(str(pdf), *PROMPTS, "--max-new-tokens", "8", "--longest-side", "448")
        ingested = "SELECT count(*) FROM sources WHERE job_id = :id AND status = 'ingested'"
        _wait_until(lambda: _scalar(fleet, ingested, id=job) == 1, fleet)
        proxy.cut()
        fleet.start_worker("encode,generate")
        _wait_until(lambda: _retried(fleet), fleet, timeout=120)
        proxy.restore()
        fleet.wait([job], timeout=300)
        failed = _units(fleet, job, "failed")
        assert failed == 0, fleet.logs()
        _exactly_once(fleet, job, 8)
    finally:
        fleet.kill_all()
        fleet.close()
        proxy.close()


def test_cancel_stops_a_running_generate_flush(fleet, tmp_path):
    """`visbatch cancel` while a generate worker is mid-job: its requests in flight are aborted
    within a poll, nothing more is stored, and the cancel itself needs no model."""
    pdf = write_pdf(tmp_path / "doc.pdf", pages=16)
    fleet.set(max_batch_size="4")
    fleet.start_worker("ingest")
    fleet.start_worker("encode,generate")
    job = fleet.submit(str(pdf), "-p", "a?", "-p", "b?", "-p", "c?", "--max-new-tokens", "200",
                       "--longest-side", "448")  # fmt: skip
    _wait_until(lambda: fleet.result_count(job) >= 4, fleet)
    out = fleet.run_cli("cancel", job)
    assert "cancelled" in out
    at_cancel = fleet.result_count(job)
    # The event: the generate worker's poll has seen the cancel and dropped the job's units
    # (GenerateLoop.drop_jobs); then three more polls and flushes, in which nothing may land.
    _wait_until(lambda: f"of stopped job(s) {job}" in fleet.logs(tail=10**7), fleet, timeout=60)
    time.sleep(3)
    # What was being stored at that instant may land; nothing generated after it does.
    assert fleet.result_count(job) <= at_cancel + 4, fleet.logs()
    assert fleet.status(job) == "cancelled"
    assert fleet.result_count(job) < 16 * 3
