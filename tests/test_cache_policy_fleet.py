"""The cache policy in the fleet driver: real `visbatch worker` processes (Celery on the shared
Redis broker, PostgreSQL), a cache Redis of the test's own (every key in it is ours) in front of
S3 on moto; three jobs, one per policy, and what each tier holds afterwards. The GPU worker's
start-up check of that cache Redis (it has no maxmemory) is in its log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from storage.token_cache import REDIS_NAMESPACE
from tests.faults import RedisServer
from tests.fleet_harness import Fleet
from tests.media import write_pdf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fleet,
    pytest.mark.faults,
    pytest.mark.usefixtures("redis_url"),
    # 157 s at load average 10 on 2 cores (2026-12-02): a fleet's start, three jobs one after another.
    pytest.mark.budget(240, reason="a fleet's start and three jobs, each policy's tiers inspected"),
]


@pytest.fixture
def cache_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "cache-redis", "--appendonly", "no", "--maxmemory", "0",
                         "--maxmemory-policy", "allkeys-lru")  # fmt: skip
    yield server
    server.stop()


@pytest.fixture
def fleet(tmp_path, tiny_model_dir, postgres_url, cache_redis, s3_server, s3_bucket) -> Iterator[Fleet]:
    f = Fleet(tmp_path, tiny_model_dir, postgres_url)
    f.set(cache_url=cache_redis.url, cache_cold_url=f"s3://{s3_bucket}/cache", s3_endpoint_url=s3_server)
    yield f
    f.kill_all()
    f.close()


def _cold_keys(s3_client: Any, bucket: str) -> list[str]:
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="cache/tokens/")
    return [item["Key"] for item in listed.get("Contents", [])]


def test_each_policy_in_the_fleet(fleet, tmp_path, cache_redis, s3_client, s3_bucket) -> None:
    pdfs = {
        policy: write_pdf(tmp_path / f"{policy}.pdf", pages=2, text=f"Invoice of the {policy} job")
        for policy in ("cold", "hot", "none")
    }
    fleet.start_worker("ingest")
    fleet.start_worker("encode,generate")
    client = redis.Redis.from_url(cache_redis.url)
    try:
        hot_keys: dict[str, int] = {}
        cold_keys: dict[str, int] = {}
        for policy, pdf in pdfs.items():
            job = fleet.submit(
                str(pdf), "-p", "What is on this page?", "--max-new-tokens", "2", "--cache", policy
            )
            fleet.wait([job])
            assert fleet.status(job) == "succeeded", fleet.logs()
            assert fleet.result_count(job) == 2
            assert f"(cache policy {policy})" in fleet.run_cli("status", job)
            hot_keys[policy] = len(list(client.scan_iter(match=f"{REDIS_NAMESPACE}*")))
            cold_keys[policy] = len(_cold_keys(s3_client, s3_bucket))
    finally:
        client.close()
    # After each job, in order: cold added 2 entries to both tiers; hot 2 to Redis alone; none
    # left nothing behind in either.
    assert hot_keys == {"cold": 2, "hot": 4, "none": 4}
    assert cold_keys == {"cold": 2, "hot": 2, "none": 2}
    assert "has no maxmemory" in fleet.logs(tail=10**6)  # the GPU worker's start-up check
