"""The ingest stage for one source: detect, hash, split into images, store them, count visual tokens.

The token count comes from the model's own resize rule, handed in as a function, so that
generation batches can be packed before any GPU work and ingest needs no model weights.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from ingest.detect import detect_kind
from ingest.spec import IngestOptions
from ingest.split import split_source
from ingest.units import RenderedImage, SourceKind, UnitFailure
from storage.object_store import ObjectStore
from storage.repository import UnitRow

TokenCounter = Callable[[int, int], int]  # (width, height) -> visual tokens

# Fast PNG: level 1 is ~5x faster to write than the default and only ~15% larger;
# ingest is CPU-bound and must not starve the GPU stages.
PNG_COMPRESS_LEVEL = 1


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
    return f"images/{digest[:2]}/{digest}.png"


def store_image(store: ObjectStore, image: Image.Image) -> str:
    key = image_key(image_hash(image))
    if not store.exists(key):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
        store.put_bytes(key, buffer.getvalue())
    return key


@dataclass(frozen=True)
class SourceInfo:
    kind: SourceKind
    sha256: str
    size: int


def inspect_source(path: Path) -> SourceInfo:
    """Kind by content, hash and size. Raises SourceError (or OSError) for unreadable sources."""
    kind = detect_kind(path)
    sha, size = file_sha256(path)
    return SourceInfo(kind=kind, sha256=sha, size=size)


def unit_rows(
    path: Path,
    kind: SourceKind,
    options: IngestOptions,
    store: ObjectStore,
    count_tokens: TokenCounter,
) -> Iterator[UnitRow]:
    """One row per page or frame; a page or frame that fails is a row with an error, not an exception."""
    for item in split_source(path, kind, options):
        if isinstance(item, UnitFailure):
            yield UnitRow(
                index=item.index,
                width=None,
                height=None,
                image_key=None,
                visual_tokens=None,
                timestamp=item.timestamp,
                error=item.message,
            )
            continue
        yield _row(item, store, count_tokens)


def _row(item: RenderedImage, store: ObjectStore, count_tokens: TokenCounter) -> UnitRow:
    width, height = item.image.size
    try:
        tokens = count_tokens(width, height)
    except ValueError as exc:  # e.g. an aspect ratio the model's resize rule refuses
        return UnitRow(
            index=item.index,
            width=width,
            height=height,
            image_key=None,
            visual_tokens=None,
            timestamp=item.timestamp,
            text=item.text,
            error=f"cannot be encoded: {exc}",
        )
    key = store_image(store, item.image)
    return UnitRow(
        index=item.index,
        width=width,
        height=height,
        image_key=key,
        visual_tokens=tokens,
        timestamp=item.timestamp,
        text=item.text,
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
