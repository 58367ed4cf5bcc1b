"""Is the cache Redis big enough for the pages this worker keeps in flight? Checked at worker start.

A hot tier smaller than the pages in flight evicts entries between encode and generate: generate
then re-encodes them (the tower runs twice) or, under `--cache cold`, reads them back from S3.
Nothing fails, everything gets slower, so the worker says it once, with the numbers, at start
(worker.planning.fleet_sizing has the formula; docs/scale.md the table).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from storage.token_cache import RedisTokenCache, TokenCache, hot_tier
from worker.planning.fleet_sizing import HOT_SAFETY_FACTOR, entry_bytes, hot_tier_bytes, model_shape

log = logging.getLogger(__name__)

# The page the check sizes for: an A4 page rendered at the default 1288 px longest side.
A4_PAGE_PX = (911, 1288)


@dataclass(frozen=True)
class RedisMemory:
    maxmemory: int  # bytes; 0: no limit
    policy: str


def redis_memory(client: Any) -> RedisMemory:
    """maxmemory and its policy: CONFIG GET, or INFO memory where CONFIG is refused (managed Redis
    services rename or forbid it)."""
    import redis

    try:
        config = client.config_get("maxmemory*")
        return RedisMemory(int(config.get("maxmemory", 0)), str(config.get("maxmemory-policy", "")))
    except redis.ResponseError:
        info = client.info("memory")
        return RedisMemory(int(info.get("maxmemory", 0)), str(info.get("maxmemory_policy", "")))


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def hot_tier_warning(cache: TokenCache, need_bytes: int, *, per_page: int, pages: int) -> str | None:
    """Why this cache's hot tier (if Redis) cannot hold `need_bytes`, or None when it can (or is
    not Redis, or cannot be asked: the hot tier's own warning says it is down)."""
    tier = hot_tier(cache)
    if not isinstance(tier, RedisTokenCache):
        return None
    try:
        memory = redis_memory(tier.client)
    except Exception as exc:  # down or refusing: RedisTokenCache warns about it when used
        log.debug("could not read the cache Redis' memory settings: %s", exc)
        return None
    if per_page > tier.max_entry_bytes:
        return (
            f"token cache Redis {tier.label}: a page's entry ({_mb(per_page)}) is over "
            f"VISBATCH_CACHE_HOT_MAX_ENTRY_BYTES ({_mb(tier.max_entry_bytes)}), so pages never enter "
            "Redis: generate reads them from S3 (--cache cold) or encodes them again (hot, none); "
            "raise it (docs/scale.md)"
        )
    sizing = (f"{pages} pages in flight x {_mb(per_page)} a page x {HOT_SAFETY_FACTOR:g} (safety) = "
              f"{_mb(need_bytes)} for this worker")  # fmt: skip
    if memory.policy and memory.policy != "allkeys-lru":
        return (
            f"token cache Redis {tier.label}: maxmemory-policy is {memory.policy}, not allkeys-lru: "
            "once full, every put fails and the hot tier is skipped; set allkeys-lru (docs/scale.md)"
        )
    if memory.maxmemory == 0:
        return (
            f"token cache Redis {tier.label} has no maxmemory: it grows until the machine runs out; "
            f"set maxmemory to at least {sizing}, times the GPU workers sharing it (docs/scale.md)"
        )
    if memory.maxmemory < need_bytes:
        return (
            f"token cache Redis {tier.label}: maxmemory {_mb(memory.maxmemory)} cannot hold {sizing} "
            "(times the GPU workers sharing it): pages are evicted before they are answered and "
            "encoded again; raise maxmemory, or lower --concurrency (docs/scale.md)"
        )
    return None


def worker_hot_tier_warning(
    cache: TokenCache, config: dict[str, Any], visual_tokens: int, element_bytes: int, pages: int
) -> str | None:
    """The check for a worker of `pages` in flight, for a model of this config whose typical page
    is `visual_tokens` tokens (rt.token_rule.count_visual_tokens(*A4_PAGE_PX))."""
    per_page = entry_bytes(visual_tokens, model_shape(config), element_bytes)
    need = hot_tier_bytes(per_page, 1, pages)
    return hot_tier_warning(cache, need, per_page=per_page, pages=pages)
