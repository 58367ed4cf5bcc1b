"""The visual-token cache: opaque bytes (safetensors) by key, bounded in bytes, least recently used out.

It knows nothing of tensors: the worker serializes and validates entries (worker.visual_tokens).
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from storage.keys import check_key


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0


class TokenCache(Protocol):
    stats: CacheStats

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...


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
        check_key(key)
        return self.root / key[:2] / f"{key}.safetensors"

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


def open_token_cache(url: str, max_bytes: int) -> TokenCache:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return FolderTokenCache(Path(parsed.path if parsed.scheme else url), max_bytes)
    raise ValueError(f"unsupported token cache URL scheme {parsed.scheme!r} (use file://...)")
