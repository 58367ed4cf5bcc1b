"""Object keys that can never escape their store: no '..', no absolute paths, no control characters."""

from __future__ import annotations

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
