"""`visbatch ingest`: the ingest stage alone, writing page and frame images and a manifest to a folder."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ingest.spec import IngestOptions
from ingest.split import split_source
from ingest.stage import PNG_COMPRESS_LEVEL, TokenCounter, expand_paths, inspect_source
from ingest.units import SourceError, UnitFailure

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def folder_name(path: Path) -> str:
    """A safe, unique folder name per source: sanitized stem plus a short hash of the full path."""
    stem = _UNSAFE.sub("_", path.stem).strip("._")[:60] or "source"
    return f"{stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def export_sources(
    paths: list[Path], out_dir: Path, options: IngestOptions, count_tokens: TokenCounter
) -> Iterator[dict[str, Any]]:
    """Write images under out_dir/<source>/ and one manifest line per unit (or per failed source)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "manifest.jsonl", "w") as manifest:
        for path in expand_paths(paths):
            for record in _export_one(path, out_dir, options, count_tokens):
                manifest.write(json.dumps(record) + "\n")
                yield record


def _export_one(
    path: Path, out_dir: Path, options: IngestOptions, count_tokens: TokenCounter
) -> Iterator[dict[str, Any]]:
    source = str(path)
    try:
        info = inspect_source(path)
        folder = out_dir / folder_name(path)
        folder.mkdir(exist_ok=True)
        name = "frame" if info.kind == "video" else "page" if info.kind == "pdf" else "image"
        for item in split_source(path, info.kind, options):
            base = {"source": source, "kind": info.kind, "unit": item.index, "timestamp": item.timestamp}
            if isinstance(item, UnitFailure):
                yield {**base, "error": item.message}
                continue
            file = folder / f"{name}-{item.index + 1:05d}.png"
            item.image.save(file, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
            try:
                tokens: int | None = count_tokens(*item.image.size)
            except ValueError:
                tokens = None
            yield {
                **base,
                "file": str(file.relative_to(out_dir)),
                "width": item.image.width,
                "height": item.image.height,
                "visual_tokens": tokens,
                "text": item.text,
            }
    except SourceError as exc:
        yield {"source": source, "error": str(exc)}
    except OSError as exc:
        yield {"source": source, "error": f"cannot read: {exc.strerror or exc}"}
