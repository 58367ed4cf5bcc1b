"""The fleet's token cache: Redis (hot) in front of S3 (cold), against a real Redis and moto."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch

from storage.object_store import S3ObjectStore
from storage.token_cache import (
    RedisTokenCache,
    S3TokenCache,
    TieredTokenCache,
    open_token_cache,
)
from worker.models.base import ModelAdapter
from worker.tokens.store import VisualTokenStore
from worker.tokens.tensors import TokenSpec, VisualTokens

TTL = 3600
CAP = 64 * 1024


def _key(n: int) -> str:
    return f"{n:064x}"


@pytest.fixture
def redis_client(redis_url: str) -> Any:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def cold_store(s3_client: Any, s3_bucket: str) -> S3ObjectStore:
    return S3ObjectStore(s3_bucket, "cache", client=s3_client)


@pytest.fixture
def hot(redis_url: str, redis_prefix: str) -> RedisTokenCache:
    return RedisTokenCache.from_url(redis_url, ttl_seconds=TTL, max_entry_bytes=CAP, namespace=redis_prefix)


@pytest.fixture
def tiered(hot: RedisTokenCache, cold_store: S3ObjectStore) -> TieredTokenCache:
    return TieredTokenCache(hot, S3TokenCache(cold_store))


def _cold_key(key: str) -> str:
    return f"tokens/{key[:2]}/{key}.safetensors"


def test_miss(tiered: TieredTokenCache) -> None:
    assert tiered.get(_key(1)) is None
    assert (tiered.stats.hits, tiered.stats.misses) == (0, 1)


def test_put_writes_both_tiers_and_hot_hit(
    tiered: TieredTokenCache, redis_client: Any, redis_prefix: str, cold_store: S3ObjectStore
) -> None:
    key = _key(2)
    tiered.put(key, b"entry")
    assert redis_client.get(redis_prefix + key) == b"entry"
    assert 0 < redis_client.ttl(redis_prefix + key) <= TTL
    assert cold_store.get_bytes(_cold_key(key)) == b"entry"
    assert tiered.get(key) == b"entry"
    stats = tiered.stats
    assert (stats.hits, stats.hot_hits, stats.cold_hits, stats.misses) == (1, 1, 0, 0)


def test_cold_hit_refills_hot(
    tiered: TieredTokenCache, redis_client: Any, redis_prefix: str, cold_store: S3ObjectStore
) -> None:
    key = _key(3)
    cold_store.put_bytes(_cold_key(key), b"from s3")  # e.g. Redis evicted it, or a fresh Redis
    assert redis_client.get(redis_prefix + key) is None
    assert tiered.get(key) == b"from s3"
    assert redis_client.get(redis_prefix + key) == b"from s3"
    assert tiered.get(key) == b"from s3"
    stats = tiered.stats
    assert (stats.hits, stats.hot_hits, stats.cold_hits, stats.misses) == (2, 1, 1, 0)


def test_delete_drops_both_tiers(
    tiered: TieredTokenCache, redis_client: Any, redis_prefix: str, cold_store: S3ObjectStore
) -> None:
    key = _key(4)
    tiered.put(key, b"x")
    tiered.delete(key)
    assert redis_client.get(redis_prefix + key) is None
    assert not cold_store.exists(_cold_key(key))
    assert tiered.get(key) is None
    tiered.delete(key)  # deleting nothing is fine


def test_entry_over_cap_stays_cold_only(
    tiered: TieredTokenCache, redis_client: Any, redis_prefix: str, cold_store: S3ObjectStore
) -> None:
    key = _key(5)
    big = b"b" * (CAP + 1)
    tiered.put(key, big)
    assert redis_client.get(redis_prefix + key) is None
    assert tiered.get(key) == big  # a cold hit, and the refill skips Redis too
    assert redis_client.get(redis_prefix + key) is None
    assert tiered.stats.cold_hits == 1


def _token_store(cache: Any) -> VisualTokenStore:
    # lookup() only needs the adapter's fingerprint and shapes; no model is loaded.
    spec = TokenSpec(hidden_size=4, dtype=torch.float32, tokens_for_grid=lambda grid: int(grid.prod()) // 4)
    adapter = SimpleNamespace(fingerprint="fp-test", token_spec=spec)
    adapter.decode_tokens = lambda data, fp=None: ModelAdapter.decode_tokens(adapter, data, fp)
    return VisualTokenStore(adapter, cache, store=None)  # type: ignore[arg-type]


def _valid_entry() -> bytes:
    tokens = VisualTokens(embeds=torch.ones(1, 4), grid_thw=torch.tensor([[1, 2, 2]]))
    return tokens.to_bytes("fp-test")


def test_corrupt_cold_entry_is_dropped_and_not_refilled(
    tiered: TieredTokenCache, redis_client: Any, redis_prefix: str, cold_store: S3ObjectStore
) -> None:
    key = _key(6)
    cold_store.put_bytes(_cold_key(key), b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    tokens = _token_store(tiered)
    assert tokens.lookup(key) is None  # the get refilled Redis with it, then the validator dropped it
    assert tokens.stats.corrupt_entries == 1
    assert redis_client.get(redis_prefix + key) is None
    assert not cold_store.exists(_cold_key(key))
    assert tiered.get(key) is None  # gone from both: the next lookup re-encodes

    tiered.put(key, _valid_entry())
    found = tokens.lookup(key)
    assert found is not None and found.num_tokens == 1


def test_redis_down_goes_on_with_s3(
    closed_port: int, cold_store: S3ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    hot = RedisTokenCache.from_url(f"redis://127.0.0.1:{closed_port}/0", ttl_seconds=TTL, max_entry_bytes=CAP)
    cache = TieredTokenCache(hot, S3TokenCache(cold_store))
    caplog.set_level(logging.WARNING, logger="storage.token_cache")
    started = time.monotonic()
    assert cache.get(_key(7)) is None
    cache.put(_key(7), b"still works")
    assert cache.get(_key(7)) == b"still works"
    cache.put(_key(8), b"again")
    cache.delete(_key(8))
    assert cache.get(_key(8)) is None
    assert time.monotonic() - started < 5
    assert cold_store.get_bytes(_cold_key(_key(7))) == b"still works"
    assert not hot.available
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1, "one warning per outage, not one per call"
    assert (cache.stats.cold_hits, cache.stats.hot_hits) == (1, 0)


def test_redis_comes_back(
    redis_url: str, redis_prefix: str, closed_port: int, cold_store: S3ObjectStore
) -> None:
    hot = RedisTokenCache.from_url(
        f"redis://127.0.0.1:{closed_port}/0", namespace=redis_prefix, retry_after_s=0.05
    )
    cache = TieredTokenCache(hot, S3TokenCache(cold_store))
    cache.put(_key(9), b"v")  # Redis down: cold only
    hot.client = redis.Redis.from_url(redis_url)  # "Redis restarted"
    time.sleep(0.1)
    assert cache.get(_key(9)) == b"v"  # cold hit, refilled into the Redis that is back
    assert cache.get(_key(9)) == b"v"
    assert (cache.stats.cold_hits, cache.stats.hot_hits) == (1, 1)
    hot.client.close()


def test_redis_password_never_in_messages(closed_port: int, caplog: pytest.LogCaptureFixture) -> None:
    hot = RedisTokenCache.from_url(f"redis://:s3cret@127.0.0.1:{closed_port}/2")
    caplog.set_level(logging.WARNING, logger="storage.token_cache")
    assert hot.get(_key(10)) is None
    assert "s3cret" not in repr(hot) and "s3cret" not in caplog.text
    assert f"127.0.0.1:{closed_port}/2" in caplog.text


def test_open_token_cache_fleet_urls(redis_url: str, s3_server: str, s3_bucket: str, tmp_path: Any) -> None:
    cache = open_token_cache(
        redis_url, 1 << 20, cold_url=f"s3://{s3_bucket}/cache", endpoint_url=s3_server, ttl_seconds=60
    )
    assert isinstance(cache, TieredTokenCache)
    assert isinstance(cache.hot, RedisTokenCache) and cache.hot.ttl_seconds == 60
    assert isinstance(cache.cold, S3TokenCache)
    # A local SSD folder in front of S3 works the same way.
    local = open_token_cache(
        f"file://{tmp_path}/hot", 1 << 20, cold_url=f"s3://{s3_bucket}/cache", endpoint_url=s3_server
    )
    local.put(_key(11), b"z")
    assert local.get(_key(11)) == b"z"
    with pytest.raises(ValueError):
        open_token_cache("memcached://x", 1)
