"""The ingest stage's file-level helpers: hash a source, check it, walk folders, name and store an
image by its pixels. (Each unit's row and token count: ingest.budget_rows.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from PIL import Image

from ingest.image_file import IMAGE_SUFFIX, encode_image
from ingest.limits import Limits
from ingest.units import SourceError
from storage.object_store import ObjectStore

DEFAULT_LIMITS = Limits()


def file_sha256(path: Path, chunk: int = 1 << 20) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def image_hash(image: Image.Image) -> str:
    """Hash of the pixels (not of an encoding), so equal pages or frames share one cache entry."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def image_key(digest: str) -> str:
    """The one place that names a stored image: images/<h[:2]>/<h><suffix>, h the pixel hash.

    worker.tokens.store.image_hash_of reads h back as the key's stem.
    """
    return f"images/{digest[:2]}/{digest}{IMAGE_SUFFIX}"


def store_image(store: ObjectStore, image: Image.Image) -> str:
    """Store the image under its pixel hash (once: an equal page or frame is already there)."""
    key = image_key(image_hash(image))
    if not store.exists(key):
        store.put_bytes(key, encode_image(image))
    return key


def check_source(path: Path, limits: Limits = DEFAULT_LIMITS) -> None:
    """What the worker checks itself before a child process reads a byte of the file."""
    if not path.exists():
        raise SourceError("file not found")
    if not path.is_file():  # a FIFO or device would block the reader forever
        raise SourceError("not a regular file")
    size = path.stat().st_size
    if size > limits.max_source_bytes:
        raise SourceError(
            f"file is {size / 1e6:,.1f} MB, over the limit of {limits.max_source_bytes / 1e6:,.1f} MB "
            "(VISBATCH_LIMIT_MAX_SOURCE_BYTES)"
        )


def expand_paths(paths: list[Path]) -> list[Path]:
    """Files as given, folders walked (sorted, hidden entries skipped), duplicates removed."""
    seen: dict[Path, None] = {}
    for path in paths:
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                rel = child.relative_to(path)
                if child.is_file() and not any(part.startswith(".") for part in rel.parts):
                    seen.setdefault(child.resolve(), None)
        else:
            seen.setdefault(path.resolve() if path.exists() else path, None)
    return list(seen)
