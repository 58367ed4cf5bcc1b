"""The worker's start-up check of the cache Redis against the pages it keeps in flight, against
redis-servers of the test's own with a small, a large and no maxmemory, and the wrong policy."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.token_cache import FolderTokenCache, RedisTokenCache, S3TokenCache, TieredTokenCache
from tests.faults import RedisServer
from worker.planning.cache_check import hot_tier_warning, redis_memory, worker_hot_tier_warning
from worker.planning.fleet_sizing import entry_bytes, hot_tier_bytes, model_shape, pages_in_flight_per_gpu

pytestmark = pytest.mark.faults

# Qwen2.5-VL-7B's published config (the fields sizing reads): 3,584-wide tokens in bf16.
QWEN25_VL_7B = {
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 3584,
                      "spatial_merge_size": 2},
}  # fmt: skip
A4_TOKENS = 1518  # an A4 page at 1288 px through Qwen2-VL's rule (docs/budget.md)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Any]:
    started: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(started)}", "--appendonly", "no", *args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _cache(server: RedisServer, tmp_path: Path) -> TieredTokenCache:
    # The hot tier is what is checked; the cold one is never touched by the check.
    cold = S3TokenCache(store=None)  # type: ignore[arg-type]
    return TieredTokenCache(RedisTokenCache.from_url(server.url), cold)


def _worker_warning(server: RedisServer, tmp_path: Path, threads: int = 64) -> str | None:
    pages = pages_in_flight_per_gpu(threads, 16)
    return worker_hot_tier_warning(_cache(server, tmp_path), QWEN25_VL_7B, A4_TOKENS, 2, pages)


def test_small_maxmemory_warns_with_the_numbers(servers, tmp_path) -> None:
    server = servers("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    warning = _worker_warning(server, tmp_path)
    assert warning is not None
    # 80 pages x 10.9 MB (1,518 tokens x 3,584 x 2 bytes) x 2 = 1,743 MB
    per_page = entry_bytes(A4_TOKENS, model_shape(QWEN25_VL_7B), 2)
    assert per_page == A4_TOKENS * 3584 * 2 + 324
    assert f"{hot_tier_bytes(per_page, 1, 80) / 1e6:,.0f} MB" in warning
    assert "maxmemory 67 MB cannot hold 80 pages in flight" in warning
    assert "127.0.0.1" in warning and "raise maxmemory" in warning


def test_enough_maxmemory_is_quiet(servers, tmp_path) -> None:
    server = servers("--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru")
    assert _worker_warning(server, tmp_path) is None
    # ... until the worker takes more threads than it holds.
    assert "cannot hold 272 pages in flight" in (_worker_warning(server, tmp_path, threads=256) or "")


def test_no_maxmemory_and_wrong_policy_warn(servers, tmp_path) -> None:
    unbounded = servers("--maxmemory", "0", "--maxmemory-policy", "allkeys-lru")
    assert "has no maxmemory" in (_worker_warning(unbounded, tmp_path) or "")
    noeviction = servers("--maxmemory", "4gb")  # RedisServer's default policy: noeviction
    assert redis_memory(RedisTokenCache.from_url(noeviction.url).client).policy == "noeviction"
    assert "not allkeys-lru" in (_worker_warning(noeviction, tmp_path) or "")


def test_an_entry_over_the_hot_cap_warns(servers, tmp_path) -> None:
    """Qwen3-VL-8B's page (1,120 tokens x 4,096 x 4 layers x bf16 = 36.7 MB) is over the default
    32 MiB cap of a Redis entry: it would never enter the hot tier."""
    server = servers("--maxmemory", "64gb", "--maxmemory-policy", "allkeys-lru")
    deepstack = {**QWEN25_VL_7B["vision_config"], "deepstack_visual_indexes": [8, 16, 24]}
    qwen3 = {**QWEN25_VL_7B, "hidden_size": 4096, "vision_config": deepstack}
    warning = worker_hot_tier_warning(_cache(server, tmp_path), qwen3, 1120, 2, 80)
    assert warning is not None and "is over VISBATCH_CACHE_HOT_MAX_ENTRY_BYTES" in warning
    assert "37 MB" in warning


def test_not_redis_or_down_is_not_checked(tmp_path, closed_port) -> None:
    folder = FolderTokenCache(tmp_path / "cache", 1024)
    assert hot_tier_warning(folder, 10**12, per_page=1, pages=1) is None
    down = RedisTokenCache.from_url(f"redis://127.0.0.1:{closed_port}/0")
    assert hot_tier_warning(down, 10**12, per_page=1, pages=1) is None


def test_worker_start_logs_it(servers, tmp_path, settings_factory, caplog) -> None:
    """`visbatch worker`'s start-up step, on the tiny model with a 1 MB cache Redis."""
    from worker.cli.main import _check_hot_tier
    from worker.runtime import Runtime

    server = servers("--maxmemory", "1mb", "--maxmemory-policy", "allkeys-lru")
    rt = Runtime(settings_factory(cache_url=server.url))
    rt.load_model()
    with caplog.at_level(logging.WARNING, logger="worker.planning.cache_check"):
        _check_hot_tier(rt, 64)
    assert any("cannot hold 80 pages in flight" in r.getMessage() for r in caplog.records), caplog.text
