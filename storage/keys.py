"""Object keys that can never escape their store: no '..', no absolute paths, no control characters."""

from __future__ import annotations

import hashlib
import re

_SAFE_SEGMENT = re.compile(r"^[A-Za-z0-9._=-]+$")


class UnsafeKey(ValueError):
    pass


def check_key(key: str) -> str:
    """Return `key` if every '/'-separated segment is plain; raise UnsafeKey otherwise.

    Keys are built by visbatch from content hashes, so anything else is a bug or an attack.
    """
    if not key or key.startswith("/") or len(key) > 512:
        raise UnsafeKey(f"unsafe object key {key!r}")
    for segment in key.split("/"):
        if segment in ("", ".", "..") or not _SAFE_SEGMENT.match(segment):
            raise UnsafeKey(f"unsafe object key {key!r}")
    return key


def window_view_key(cache_key: str) -> str:
    """The token-cache key of an image's window view (worker.models.base.ModelAdapter
    .has_window_view), derived from its usual entry's key: whoever deletes an entry (purge, cache
    policy `none`) deletes its window view with it, without knowing the model."""
    return hashlib.sha256(f"{cache_key}:window-view".encode()).hexdigest()
