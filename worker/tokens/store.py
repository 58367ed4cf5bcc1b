"""The visual-token store: images -> visual tokens through the token cache, so that no image is
encoded twice (what the encode stage, worker.stages.encode, and request building call)."""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import threading
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Protocol

from PIL import Image, UnidentifiedImageError

from ingest.budget import PixelBounds
from storage.keys import window_view_key
from storage.object_store import ObjectNotFound, ObjectStore
from storage.token_cache import DEFAULT_NONE_TTL_SECONDS, TokenCache, cache_for_policy
from worker import metrics
from worker.retry import describe, is_transient
from worker.tokens.tensors import InvalidVisualTokens, VisualTokens

log = logging.getLogger(__name__)


def image_hash_of(image_key: str) -> str:
    """Images are stored as images/<h[:2]>/<h>.png where h is the hash of their pixels."""
    return PurePosixPath(image_key).stem


@dataclass(frozen=True)
class EncodeOutcome:
    unit_id: int
    cache_key: str | None
    cache_hit: bool
    error: str | None = None


class TokenCodec(Protocol):
    """What the store needs of a model (its adapter, worker.models): the cache key and fingerprint
    of its preprocessing, the tower, and reading an entry back. Tokens sit below models: the
    adapter is handed in, never imported here."""

    fingerprint: str
    has_window_view: bool

    def fingerprint_for(self, bounds: PixelBounds | None, window_view: bool = False) -> str: ...

    def cache_key(
        self, image_hash: str, bounds: PixelBounds | None = None, window_view: bool = False
    ) -> str: ...

    def encode(self, images: list[Image.Image], bounds: PixelBounds | None = None) -> list[VisualTokens]: ...

    def encode_window_view(
        self, images: list[Image.Image], bounds: PixelBounds | None = None
    ) -> list[VisualTokens]: ...

    def decode_tokens(self, data: bytes, fingerprint: str) -> VisualTokens: ...


@dataclass
class EncodeStats:
    tower_calls: int = 0
    images_encoded: int = 0
    corrupt_entries: int = 0


class VisualTokenStore:
    """Gets an image's visual tokens from the cache, or from the tower (and then caches them)."""

    def __init__(
        self,
        adapter: TokenCodec,
        cache: TokenCache,
        store: ObjectStore,
        batch_images: int = 8,
        *,
        none_ttl_seconds: int = DEFAULT_NONE_TTL_SECONDS,
        compress: bool = False,
    ) -> None:
        self.adapter = adapter
        self.cache = cache
        self.store = store
        self.batch_images = max(1, batch_images)
        self.none_ttl_seconds = none_ttl_seconds
        self.compress = compress  # write entries zstd-compressed (both kinds always read)
        self.policy = "cold"
        self.stats = EncodeStats()
        # One tower call at a time per process: a fleet worker runs encode tasks in threads.
        self._tower = threading.Lock()
        self._views: dict[str, VisualTokenStore] = {"cold": self}

    def for_policy(self, policy: str) -> VisualTokenStore:
        """This store as a job of cache policy `policy` uses it (ingest.spec.CachePolicy): the same
        model, tower lock and counters over the part of the cache the policy allows."""
        view = self._views.get(policy)
        if view is None:
            view = copy.copy(self)  # shares adapter, stats, the tower lock and the views
            view.cache = cache_for_policy(self.cache, policy, none_ttl_seconds=self.none_ttl_seconds)
            view.policy = policy
            self._views[policy] = view
        return view

    def cache_key(self, image_key: str, bounds: PixelBounds | None = None, window_view: bool = False) -> str:
        """Content + preprocessing (the job's resize bounds included) + model; the image's window
        view (worker.models.base.ModelAdapter.has_window_view) is another entry."""
        return self.adapter.cache_key(image_hash_of(image_key), bounds, window_view)

    def _fingerprint(self, bounds: PixelBounds | None, window_view: bool = False) -> str:
        if bounds is None and not window_view:
            return self.adapter.fingerprint
        return self.adapter.fingerprint_for(bounds, window_view)

    def lookup(
        self, cache_key: str, bounds: PixelBounds | None = None, window_view: bool = False
    ) -> VisualTokens | None:
        """A validated cache entry, or None. A corrupt entry is dropped so it gets re-encoded."""
        before = dataclasses.replace(self.cache.stats)
        data = self.cache.get(cache_key)
        _count_lookup(self.cache, before)
        if data is None:
            return None
        try:
            return self.adapter.decode_tokens(data, self._fingerprint(bounds, window_view))
        except InvalidVisualTokens as exc:
            log.warning("dropping bad token-cache entry %s: %s", cache_key, exc)
            self.stats.corrupt_entries += 1
            self.cache.delete(cache_key)
            return None

    def _load_image(self, image_key: str) -> Image.Image:
        with Image.open(io.BytesIO(self.store.get_bytes(image_key))) as img:
            return img.convert("RGB")

    def encode_keys(
        self,
        image_keys: list[str],
        bounds: PixelBounds | None = None,
        *,
        keep: bool = True,
        window_view: bool = False,
    ) -> list[VisualTokens]:
        """Run the tower over these images (in batches; their window view if asked) and write
        every result to the cache (unless not `keep`: tokens used at once and never again)."""
        out: list[VisualTokens] = []
        fingerprint = self._fingerprint(bounds, window_view)
        encode = self.adapter.encode_window_view if window_view else self.adapter.encode
        for start in range(0, len(image_keys), self.batch_images):
            chunk = image_keys[start : start + self.batch_images]
            images = [self._load_image(k) for k in chunk]
            with self._tower:
                tokens = encode(images, bounds)
                self.stats.tower_calls += 1
                self.stats.images_encoded += len(images)
                metrics.TOWER_IMAGES.inc(len(images))
            for key, vt in zip(chunk, tokens, strict=True):
                if keep:
                    self.cache.put(
                        self.cache_key(key, bounds, window_view),
                        vt.to_bytes(fingerprint, compress=self.compress),
                    )
            out.extend(tokens)
        return out

    def get(
        self, image_key: str, bounds: PixelBounds | None = None, window_view: bool = False
    ) -> VisualTokens:
        """For generation: the cached tokens, re-encoded if the cache evicted them meanwhile (and
        cached again, except under policy ``none``: they are used now and never again)."""
        found = self.lookup(self.cache_key(image_key, bounds, window_view), bounds, window_view)
        if found is not None:
            return found
        return self.encode_keys([image_key], bounds, keep=self.policy != "none", window_view=window_view)[0]

    def forget(self, cache_key: str) -> None:
        """Policy ``none``: the unit is answered, its entries go (from the tiers this view uses):
        its window view's too, where a window made one."""
        self.cache.delete(cache_key)
        if self.adapter.has_window_view:
            self.cache.delete(window_view_key(cache_key))

    def encode_units(
        self,
        units: list[tuple[int, str]] | list[tuple[int, str, PixelBounds | None]],
        *,
        window_view: bool = False,
    ) -> list[EncodeOutcome]:
        """Make sure every (unit_id, image_key[, bounds]) has cached tokens (of the images' window
        view if asked: another entry each); hits skip the tower.

        Units sharing an image and bounds (identical pages, static frames) are encoded once; one
        tower call takes images of one bounds (the processor resizes a call alike). A transient
        error (the store, the cache or the database away) is raised, for the retry policy
        (worker.retry): it is never recorded as a unit's failure. A unit fails (its outcome
        carries the error) only for what retrying cannot fix: a missing or undecodable image,
        or a tower that refuses it.
        """
        outcomes: dict[int, EncodeOutcome] = {}
        misses: dict[tuple[str, PixelBounds | None], list[int]] = {}
        for unit in units:
            unit_id, image_key = unit[0], unit[1]
            bounds = unit[2] if len(unit) > 2 else None
            key = self.cache_key(image_key, bounds, window_view)
            # The tensors are not needed here: checking the header and shape is enough.
            if self.lookup(key, bounds, window_view) is not None:
                outcomes[unit_id] = EncodeOutcome(unit_id, key, cache_hit=True)
            else:
                misses.setdefault((image_key, bounds), []).append(unit_id)
        by_bounds: dict[PixelBounds | None, list[str]] = {}
        for image_key, bounds in misses:
            by_bounds.setdefault(bounds, []).append(image_key)
        for bounds, keys in by_bounds.items():
            for start in range(0, len(keys), self.batch_images):
                chunk = keys[start : start + self.batch_images]
                try:
                    self.encode_keys(chunk, bounds, window_view=window_view)
                    done: dict[str, str | None] = {k: None for k in chunk}
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    # One bad image must not fail the batch: each alone tells which one it was.
                    log.warning("encode batch failed (%s); encoding its images one by one", describe(exc))
                    done = {k: self._encode_alone(k, bounds, window_view) for k in chunk}
                for image_key, error in done.items():
                    key = self.cache_key(image_key, bounds, window_view)
                    for i, unit_id in enumerate(misses[(image_key, bounds)]):
                        # Only the first unit of a shared image paid for the tower.
                        outcomes[unit_id] = EncodeOutcome(unit_id, None if error else key, i > 0, error)
        return [outcomes[unit[0]] for unit in units]

    def _encode_alone(self, image_key: str, bounds: PixelBounds | None, window_view: bool) -> str | None:
        """None when the image is encoded now; the reason when it never can be. Transient errors
        are raised."""
        try:
            self.encode_keys([image_key], bounds, window_view=window_view)
            return None
        except ObjectNotFound:
            return f"image {image_key} is missing from the object store"
        except Exception as exc:
            if is_transient(exc):
                raise
            if isinstance(exc, (UnidentifiedImageError, OSError)):  # PIL: truncated or not an image
                return f"image {image_key} cannot be decoded: {describe(exc)}"
            return f"vision tower failed: {describe(exc)}"


def _count_lookup(cache: TokenCache, before: object) -> None:
    """One lookup in the metrics, by tier: a tiered cache says whether its hot (Redis) or cold (S3)
    tier served it; a single-tier cache is named by its kind (folder, redis, s3)."""
    after = cache.stats
    cache = getattr(cache, "inner", cache)  # an ExpiringTokenCache counts as the tier it wraps
    if after.hot_hits > before.hot_hits:  # type: ignore[attr-defined]
        metrics.CACHE_LOOKUPS.labels("hot", "hit").inc()
    elif after.cold_hits > before.cold_hits:  # type: ignore[attr-defined]
        metrics.CACHE_LOOKUPS.labels("cold", "hit").inc()
    else:
        tier = type(cache).__name__.removesuffix("TokenCache").lower() or "cache"
        result = "hit" if after.hits > before.hits else "miss"  # type: ignore[attr-defined]
        metrics.CACHE_LOOKUPS.labels(tier, result).inc()
