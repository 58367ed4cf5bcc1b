"""Where page and frame images are kept, by content hash.

The embedded shape uses a local folder; the fleet an S3 bucket. Both are reached through
`open_object_store(url)` so a stage never knows which one it has.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from storage.keys import check_key


class ObjectNotFound(KeyError):
    pass


class ObjectStore(Protocol):
    url: str

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def get_bytes(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...


class LocalObjectStore:
    """A folder; writes are atomic (temp file + rename), so a crash never leaves half an image."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if path.exists():  # content-addressed: same key, same bytes
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).exists()


def open_object_store(url: str) -> ObjectStore:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return LocalObjectStore(Path(parsed.path if parsed.scheme else url))
    raise ValueError(f"unsupported object store URL scheme {parsed.scheme!r} (use file://...)")
