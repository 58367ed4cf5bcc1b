"""The ingest stage for one source: detect, hash, split into images, store them, count visual tokens.

The token count comes from the model's own resize rule, handed in as a function, so that
generation batches can be packed before any GPU work and ingest needs no model weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from PIL import Image

from ingest.image_file import IMAGE_SUFFIX, encode_image
from ingest.isolation import StoredUnit
from ingest.limits import Limits
from ingest.units import SourceError, UnitFailure
from storage.object_store import ObjectStore
from storage.rows import UnitRow

TokenCounter = Callable[[int, int], int]  # (width, height) -> visual tokens

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


def unit_rows(
    items: Iterable[StoredUnit | UnitFailure], count_tokens: TokenCounter, max_tokens: int
) -> Iterator[UnitRow]:
    """One row per page or frame; a page or frame that fails is a row with an error, not an exception.

    The images were rendered and stored by the splitting process; here each unit gets its
    visual-token count from the model's resize rule (no weights needed).
    """
    for item in items:
        if isinstance(item, UnitFailure):
            yield UnitRow(
                index=item.index, width=None, height=None, image_key=None, visual_tokens=None,
                timestamp=item.timestamp, error=item.message,
            )  # fmt: skip
            continue
        yield _row(item, count_tokens, max_tokens)


def _row(item: StoredUnit, count_tokens: TokenCounter, max_tokens: int) -> UnitRow:
    error, tokens = None, None
    try:
        tokens = count_tokens(item.width, item.height)
    except ValueError as exc:  # e.g. an aspect ratio the model's resize rule refuses
        error = f"cannot be encoded: {exc}"
    if tokens is not None and tokens > max_tokens:
        error = f"{tokens} visual tokens, over the limit of {max_tokens} (VISBATCH_LIMIT_MAX_VISUAL_TOKENS)"
    return UnitRow(
        index=item.index,
        width=item.width,
        height=item.height,
        image_key=None if error else item.image_key,
        visual_tokens=None if error else tokens,
        timestamp=item.timestamp,
        text=item.text,
        error=error,
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
