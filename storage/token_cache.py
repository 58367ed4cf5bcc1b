"""The visual-token cache: opaque bytes (safetensors) by key.

It knows nothing of tensors: the worker serializes and validates entries (worker.tokens.tensors,
worker.tokens.store), and drops a bad one with ``delete`` so it gets re-encoded.

Shapes:

* embedded: ``FolderTokenCache``, a local folder bounded in bytes, least recently used out;
* fleet: ``TieredTokenCache(RedisTokenCache, S3TokenCache)``: Redis is the hot tier, S3 the cold,
  durable one. A get tries Redis, then S3 (and refills Redis from it); a put and a delete go to both.

The cache Redis must be a separate instance from the Celery broker Redis: the cache one runs
``maxmemory-policy allkeys-lru`` (it is allowed to forget anything, S3 still has it), the broker
one ``noeviction`` (an evicted task message is a lost task). The size cap of the hot tier is
therefore Redis' own ``maxmemory`` + ``allkeys-lru`` (set in docker-compose), not a tally kept
here; on top of that, an entry larger than a per-entry cap (``cache_hot_max_entry_bytes``) is
never put in Redis, so one huge video frame grid cannot push out hundreds of pages.

A job chooses how much of this it uses (its cache policy, ``cache_for_policy``): ``cold`` every
tier, ``hot`` the hot tier alone (S3 never touched), ``none`` the hot tier with a short TTL, each
entry deleted by the generate stage once its unit's answers are stored. A single-tier cache (the
embedded folder) is its own hot tier.

Redis being down never fails a get or a put: the hot tier logs one warning, answers "miss" and
skips writes, and is tried again every ``retry_after_s``; work goes on from S3, slower.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from storage.keys import UnsafeKey, check_key
from storage.object_store import ObjectNotFound, ObjectStore, open_object_store

log = logging.getLogger(__name__)

DEFAULT_TTL_SECONDS = 7 * 24 * 3600
DEFAULT_HOT_MAX_ENTRY_BYTES = 32 * 1024**2
REDIS_NAMESPACE = "visbatch:tok:"
# Short socket timeouts: a hung cache must cost a GPU worker well under a second, not minutes.
REDIS_CONNECT_TIMEOUT_S = 0.5
REDIS_SOCKET_TIMEOUT_S = 2.0
# While Redis is down, how long to go without it before trying again.
REDIS_RETRY_AFTER_S = 30.0


@dataclass
class CacheStats:
    hits: int = 0  # all tiers together
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    hot_hits: int = 0  # TieredTokenCache: hits served by the hot tier ...
    cold_hits: int = 0  # ... and by the cold tier (which then refilled the hot one)


class TokenCache(Protocol):
    stats: CacheStats

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...


def _entry_name(key: str) -> str:
    """``<key[:2]>/<key>.safetensors``: two-character fan-out keeps folders and listings small."""
    check_key(key)
    if "/" in key:
        raise UnsafeKey(f"token cache keys are flat, got {key!r}")
    return f"{key[:2]}/{key}.safetensors"


class FolderTokenCache:
    """Entries are files; a read touches the file's mtime, and eviction removes the oldest mtimes first.

    The folder is the truth (other processes may write to it too), so the size tally is
    rebuilt from disk when it looks over budget rather than trusted blindly.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._size = sum(p.stat().st_size for p in self._entries())

    def _path(self, key: str) -> Path:
        return self.root / _entry_name(key)

    def _entries(self) -> list[Path]:
        return [p for p in self.root.glob("*/*.safetensors") if p.is_file()]

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        os.utime(path)  # recency for LRU
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return  # would evict everything and still not fit
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        existed = path.exists()
        os.replace(tmp, path)
        with self._lock:
            if not existed:
                self._size += len(data)
            self.stats.bytes_written += len(data)
            if self._size > self.max_bytes:
                self._evict()

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self._size -= size

    def _evict(self) -> None:
        entries = []
        for path in self._entries():
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            entries.append((stat.st_mtime_ns, stat.st_size, path))
        self._size = sum(size for _, size, _ in entries)
        # Evict down to 90% so that a full cache does not evict on every single put.
        target = int(self.max_bytes * 0.9)
        for _, size, path in sorted(entries):
            if self._size <= target:
                break
            path.unlink(missing_ok=True)
            self._size -= size
            self.stats.evictions += 1

    @property
    def size_bytes(self) -> int:
        return self._size


class S3TokenCache:
    """The cold, durable tier: entries are objects ``tokens/<key[:2]>/<key>.safetensors`` of an
    object store (an S3 bucket prefix in the fleet). No size cap: use a bucket lifecycle rule
    to expire old entries if needed. Errors other than "not found" propagate (after botocore's
    own retries): the object store holding the images is the same service, so the stage could
    not go on anyway."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.stats = CacheStats()

    def __repr__(self) -> str:
        return f"S3TokenCache({self.store.url!r})"

    @staticmethod
    def _key(key: str) -> str:
        return f"tokens/{_entry_name(key)}"

    def get(self, key: str) -> bytes | None:
        try:
            data = self.store.get_bytes(self._key(key))
        except ObjectNotFound:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return data

    def put(self, key: str, data: bytes) -> None:
        self.store.put_bytes(self._key(key), data)
        self.stats.bytes_written += len(data)

    def delete(self, key: str) -> None:
        self.store.delete(self._key(key))


class RedisTokenCache:
    """The hot tier: ``SET <namespace><key> data EX ttl``; Redis' maxmemory + allkeys-lru bound it.

    Never raises because of Redis: any Redis error (refused, timeout, out of memory) logs one
    warning, and for ``retry_after_s`` the cache answers "miss" and skips writes without even
    trying, so a dead Redis costs one timeout per interval, not one per image.
    """

    def __init__(
        self,
        client: Any,
        *,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        max_entry_bytes: int = DEFAULT_HOT_MAX_ENTRY_BYTES,
        namespace: str = REDIS_NAMESPACE,
        retry_after_s: float = REDIS_RETRY_AFTER_S,
        label: str = "redis",
    ) -> None:
        self.client = client
        self.ttl_seconds = ttl_seconds
        self.max_entry_bytes = max_entry_bytes
        self.namespace = namespace
        self.retry_after_s = retry_after_s
        self.label = label  # host:port/db for messages; never the URL (it may hold a password)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisTokenCache:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
            socket_timeout=REDIS_SOCKET_TIMEOUT_S,
            # One immediate retry covers a pooled connection that a Redis restart closed; more
            # would only multiply the wait when Redis is really gone.
            retry=Retry(NoBackoff(), 1),
            health_check_interval=30,
        )
        parsed = urlparse(url)
        label = f"{parsed.hostname}:{parsed.port or 6379}{parsed.path or '/0'}"
        return cls(client, label=label, **kwargs)

    def __repr__(self) -> str:
        return f"RedisTokenCache({self.label!r})"

    @property
    def available(self) -> bool:
        """False while Redis is considered down (until the next retry time)."""
        return time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_after_s
            first = not self._down
            self._down = True
        if first:
            log.warning(
                "token cache Redis %s unavailable (%s: %s); going on without the hot tier, "
                "retrying every %.0f s",
                self.label,
                type(exc).__name__,
                exc,
                self.retry_after_s,
            )

    def _succeeded(self) -> None:
        if self._down:
            with self._lock:
                was_down, self._down = self._down, False
            if was_down:
                log.warning("token cache Redis %s is back", self.label)

    def get(self, key: str) -> bytes | None:
        import redis

        check_key(key)
        data = None
        if self.available:
            try:
                data = self.client.get(self.namespace + key)
                self._succeeded()
            except redis.RedisError as exc:
                self._failed(exc)
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return data  # already bytes (no decode_responses): no copy of a multi-MB entry

    def put(self, key: str, data: bytes, *, ttl_seconds: int | None = None) -> None:
        import redis

        check_key(key)
        if len(data) > self.max_entry_bytes or not self.available:
            return
        try:
            self.client.set(self.namespace + key, data, ex=ttl_seconds or self.ttl_seconds)
            self._succeeded()
        except redis.RedisError as exc:
            self._failed(exc)
            return
        self.stats.bytes_written += len(data)

    def delete(self, key: str) -> None:
        import redis

        check_key(key)
        if not self.available:
            # A bad entry left in a Redis that comes back is dropped again by whoever reads it:
            # every reader validates what it gets.
            return
        try:
            self.client.delete(self.namespace + key)
            self._succeeded()
        except redis.RedisError as exc:
            self._failed(exc)


class TieredTokenCache:
    """hot (fast, may forget) in front of cold (durable): get refills hot from cold; put and
    delete go to both, so a bad entry dropped by the validator is not refilled from either."""

    def __init__(self, hot: TokenCache, cold: TokenCache) -> None:
        self.hot = hot
        self.cold = cold
        self.stats = CacheStats()

    def __repr__(self) -> str:
        return f"TieredTokenCache({self.hot!r}, {self.cold!r})"

    def get(self, key: str) -> bytes | None:
        data = self.hot.get(key)
        if data is not None:
            self.stats.hot_hits += 1
        else:
            data = self.cold.get(key)
            if data is None:
                self.stats.misses += 1
                return None
            self.stats.cold_hits += 1
            self.hot.put(key, data)  # the next reader of this image gets it from the hot tier
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return data

    def put(self, key: str, data: bytes) -> None:
        # Durable tier first: if it fails the put fails, and no entry exists only in the tier
        # that may forget it.
        self.cold.put(key, data)
        self.hot.put(key, data)
        self.stats.bytes_written += len(data)

    def delete(self, key: str) -> None:
        # Cold first: once it is gone, only a reader that fetched it before can refill the hot
        # tier, and that reader validates (and deletes) what it got.
        self.cold.delete(key)
        self.hot.delete(key)


class ExpiringTokenCache:
    """A Redis tier whose puts expire after ``ttl_seconds`` (policy ``none``): an entry whose unit
    is never answered (a cancelled job, a failed page) goes on its own, not after the hot tier's
    days-long TTL."""

    def __init__(self, inner: RedisTokenCache, ttl_seconds: int) -> None:
        self.inner = inner
        self.ttl_seconds = ttl_seconds

    def __repr__(self) -> str:
        return f"ExpiringTokenCache({self.inner!r}, {self.ttl_seconds})"

    @property
    def stats(self) -> CacheStats:
        return self.inner.stats

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data, ttl_seconds=self.ttl_seconds)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


CACHE_POLICIES = ("cold", "hot", "none")
DEFAULT_NONE_TTL_SECONDS = 6 * 3600


def hot_tier(cache: TokenCache) -> TokenCache:
    """The tier that may forget: Redis in front of S3, or the one tier there is."""
    return cache.hot if isinstance(cache, TieredTokenCache) else cache


def cache_for_policy(
    cache: TokenCache, policy: str, *, none_ttl_seconds: int = DEFAULT_NONE_TTL_SECONDS
) -> TokenCache:
    """What a job of this cache policy reads and writes: ``cold`` the whole cache, ``hot`` its hot
    tier alone, ``none`` the hot tier with puts expiring after ``none_ttl_seconds`` (Redis; a
    folder has no expiry and is bounded by its size cap). Deleting ``none`` entries once their
    unit is answered is the generate stage's part (worker.stages.generate)."""
    if policy not in CACHE_POLICIES:
        raise ValueError(f"unknown cache policy {policy!r} (use {', '.join(CACHE_POLICIES)})")
    if policy == "cold":
        return cache
    tier = hot_tier(cache)
    if policy == "none" and isinstance(tier, RedisTokenCache):
        return ExpiringTokenCache(tier, none_ttl_seconds)
    return tier


def _open_tier(
    url: str,
    max_bytes: int,
    *,
    endpoint_url: str | None,
    ttl_seconds: int,
    hot_max_entry_bytes: int,
) -> TokenCache:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return FolderTokenCache(Path(parsed.path if parsed.scheme else url), max_bytes)
    if parsed.scheme in ("redis", "rediss"):
        return RedisTokenCache.from_url(url, ttl_seconds=ttl_seconds, max_entry_bytes=hot_max_entry_bytes)
    if parsed.scheme == "s3":
        return S3TokenCache(open_object_store(url, endpoint_url=endpoint_url))
    raise ValueError(
        f"unsupported token cache URL scheme {parsed.scheme!r} (use file://..., redis://... or s3://...)"
    )


def open_token_cache(
    url: str,
    max_bytes: int,
    *,
    cold_url: str | None = None,
    endpoint_url: str | None = None,
    ttl_seconds: int = DEFAULT_TTL_SECONDS,
    hot_max_entry_bytes: int = DEFAULT_HOT_MAX_ENTRY_BYTES,
) -> TokenCache:
    """The cache at ``url`` (file://, redis:// or s3://); with ``cold_url`` it is the hot tier in
    front of that cold one (fleet: ``redis://cache:6379/0`` + ``s3://bucket/prefix``).

    ``max_bytes`` bounds a folder tier only (Redis is bounded by its maxmemory, S3 by nothing).
    """
    options: dict[str, Any] = {
        "endpoint_url": endpoint_url,
        "ttl_seconds": ttl_seconds,
        "hot_max_entry_bytes": hot_max_entry_bytes,
    }
    cache = _open_tier(url, max_bytes, **options)
    if cold_url is None:
        return cache
    return TieredTokenCache(cache, _open_tier(cold_url, max_bytes, **options))
