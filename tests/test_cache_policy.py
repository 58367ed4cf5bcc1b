"""A job's token-cache policy (`--cache cold|hot|none`): each stores and reads what it says and
nothing else, through the embedded pipeline on the tiny model, a Redis of the test's own (so every
key in it is ours) and S3 on moto."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ingest.spec import JobSpec, Sampling
from storage import repository as repo
from storage.token_cache import (
    REDIS_NAMESPACE,
    ExpiringTokenCache,
    FolderTokenCache,
    RedisTokenCache,
    S3TokenCache,
    TieredTokenCache,
    cache_for_policy,
)
from tests.faults import RedisServer
from tests.media import write_pdf
from worker.drivers.embedded import run_job
from worker.runtime import Runtime

pytestmark = [
    pytest.mark.slow,
    pytest.mark.faults,
    pytest.mark.budget(150, reason="ten embedded runs of the tiny model, each a new runtime"),
]

PAGES = 2
NONE_TTL = 120


def _spec(cache: str) -> JobSpec:
    return JobSpec(prompts=["What is on this page?"], sampling=Sampling(max_new_tokens=3), cache=cache)


@pytest.fixture(scope="module")
def cache_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("cache-redis"), "--maxmemory-policy", "allkeys-lru",
                         "--appendonly", "no")  # fmt: skip
    yield server
    server.stop()


@pytest.fixture
def redis_client(cache_redis: RedisServer) -> Iterator[Any]:
    client = redis.Redis.from_url(cache_redis.url)
    client.flushdb()  # our own server: nobody else's keys
    yield client
    client.close()


@pytest.fixture
def fleet_settings(settings_factory, cache_redis: RedisServer, s3_server: str, s3_bucket: str):
    def make() -> Any:
        return settings_factory(
            cache_url=cache_redis.url,
            cache_cold_url=f"s3://{s3_bucket}/cache",
            s3_endpoint_url=s3_server,
            cache_none_ttl_seconds=NONE_TTL,
        )

    return make


@pytest.fixture
def pdf(tmp_path: Path) -> Path:
    (tmp_path / "in").mkdir()
    return write_pdf(tmp_path / "in" / "doc.pdf", pages=PAGES)


def _hot_keys(client: Any) -> list[bytes]:
    return list(client.scan_iter(match=f"{REDIS_NAMESPACE}*"))


def _cold_keys(s3_client: Any, bucket: str) -> list[str]:
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="cache/tokens/")
    return [item["Key"] for item in listed.get("Contents", [])]


def _run(settings: Any, pdf: Path, cache: str) -> tuple[Runtime, dict]:
    rt = Runtime(settings)
    job_id = run_job(rt, [pdf], _spec(cache))
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", summary["errors"]
    assert summary["results"] == PAGES
    assert summary["spec"]["cache"] == cache  # carried in the stored spec
    return rt, summary


def test_cold_keeps_both_tiers(fleet_settings, pdf, redis_client, s3_client, s3_bucket) -> None:
    _run(fleet_settings(), pdf, "cold")
    keys = _hot_keys(redis_client)
    assert len(keys) == PAGES
    assert all(redis_client.ttl(k) > NONE_TTL for k in keys)  # the hot tier's own TTL (days)
    assert len(_cold_keys(s3_client, s3_bucket)) == PAGES

    # Redis forgets (restart, eviction): a rerun is served by S3, the tower does not run.
    redis_client.flushdb()
    rt, summary = _run(fleet_settings(), pdf, "cold")
    assert rt.token_store.stats.images_encoded == 0
    assert (summary["cache_hits"], summary["cache_misses"]) == (PAGES, 0)
    assert len(_hot_keys(redis_client)) == PAGES  # refilled from S3


def test_hot_never_touches_s3(fleet_settings, pdf, redis_client, s3_client, s3_bucket) -> None:
    rt, summary = _run(fleet_settings(), pdf, "hot")
    assert rt.token_store.stats.images_encoded == PAGES
    assert len(_hot_keys(redis_client)) == PAGES
    assert _cold_keys(s3_client, s3_bucket) == []  # nothing written to S3

    # A rerun while Redis still holds them: hits, no tower.
    rt, summary = _run(fleet_settings(), pdf, "hot")
    assert rt.token_store.stats.images_encoded == 0
    assert summary["cache_hits"] == PAGES

    # Entries that only S3 holds (a cold job's) are not read by a hot job: it encodes again.
    redis_client.flushdb()
    _run(fleet_settings(), pdf, "cold")
    assert len(_cold_keys(s3_client, s3_bucket)) == PAGES
    redis_client.flushdb()
    rt, summary = _run(fleet_settings(), pdf, "hot")
    assert rt.token_store.stats.images_encoded == PAGES
    assert summary["cache_misses"] == PAGES

    # A `none` job over them reads the hot job's entries and leaves them: they are not its own.
    before = sorted(_hot_keys(redis_client))
    rt, summary = _run(fleet_settings(), pdf, "none")
    assert rt.token_store.stats.images_encoded == 0 and summary["cache_hits"] == PAGES
    assert sorted(_hot_keys(redis_client)) == before


def test_none_keeps_nothing_past_the_answers(fleet_settings, pdf, redis_client, s3_client, s3_bucket) -> None:
    rt, summary = _run(fleet_settings(), pdf, "none")
    assert rt.token_store.stats.images_encoded == PAGES  # encoded once: generate read them from Redis
    assert _hot_keys(redis_client) == []  # deleted once each page was answered
    assert _cold_keys(s3_client, s3_bucket) == []
    rt, _ = _run(fleet_settings(), pdf, "none")
    assert rt.token_store.stats.images_encoded == PAGES  # nothing was kept for a rerun


def test_none_in_the_embedded_folder(settings_factory, pdf) -> None:
    """The embedded run's one tier (the folder): a `none` job leaves it empty."""
    settings = settings_factory()
    _run(settings, pdf, "none")
    assert list((settings.resolved_home / "token-cache").glob("*/*.safetensors")) == []
    _run(settings, pdf, "hot")  # the folder is its own hot tier: hot keeps them there
    assert len(list((settings.resolved_home / "token-cache").glob("*/*.safetensors"))) == PAGES


def test_none_entries_expire_on_their_own(cache_redis: RedisServer, redis_client: Any) -> None:
    """An entry of a `none` job whose unit is never answered goes after the short TTL, not days."""
    hot = RedisTokenCache.from_url(cache_redis.url, ttl_seconds=7 * 24 * 3600)
    view = cache_for_policy(hot, "none", none_ttl_seconds=NONE_TTL)
    assert isinstance(view, ExpiringTokenCache)
    view.put("ab" * 32, b"entry")
    assert 0 < redis_client.ttl(REDIS_NAMESPACE + "ab" * 32) <= NONE_TTL
    assert view.get("ab" * 32) == b"entry"


def test_policy_views(tmp_path: Path, cache_redis: RedisServer, s3_client: Any, s3_bucket: str) -> None:
    from storage.object_store import S3ObjectStore

    hot = RedisTokenCache.from_url(cache_redis.url)
    tiered = TieredTokenCache(hot, S3TokenCache(S3ObjectStore(s3_bucket, "cache", client=s3_client)))
    assert cache_for_policy(tiered, "cold") is tiered
    assert cache_for_policy(tiered, "hot") is hot
    assert cache_for_policy(tiered, "none").inner is hot  # type: ignore[attr-defined]
    # The embedded run's one tier (a folder) is its own hot tier: hot and none use it.
    folder = FolderTokenCache(tmp_path / "cache", 1024)
    assert cache_for_policy(folder, "hot") is folder and cache_for_policy(folder, "none") is folder
    with pytest.raises(ValueError, match="unknown cache policy"):
        cache_for_policy(tiered, "warm")


def test_bad_policy_is_refused_with_the_option_named() -> None:
    from worker.errors import UserError
    from worker.job_options import JobOptions

    with pytest.raises(UserError, match="--cache warm"):
        JobOptions.with_defaults({"prompt": ["q"], "cache": "warm"}, python=False).spec()
    assert JobOptions.with_defaults({"prompt": ["q"], "cache": "none"}).spec().cache == "none"
    assert JobSpec(prompts=["q"]).cache == "cold"  # jobs stored before the policy existed
