"""`visbatch ingest`: the ingest stage alone, writing page and frame images and a manifest to a folder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ingest.spec import IngestOptions
from ingest.split import split_source
from ingest.stage import PNG_COMPRESS_LEVEL, TokenCounter, expand_paths, inspect_source
from ingest.units import SourceError, UnitFailure

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MANIFEST = "manifest.jsonl"


def folder_name(path: Path) -> str:
    """A safe, unique folder name per source: sanitized stem plus a short hash of the full path."""
    stem = _UNSAFE.sub("_", path.stem).strip("._")[:60] or "source"
    return f"{stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


class OutputNotEmpty(ValueError):
    """The output folder holds something already (a previous ingest, or other files)."""


def manifest_folders(out_dir: Path) -> set[Path]:
    """The per-source folders a previous ingest into `out_dir` wrote (from its manifest)."""
    folders: set[Path] = set()
    with contextlib.suppress(OSError), open(out_dir / MANIFEST) as manifest:
        for line in manifest:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                file = json.loads(line).get("file")
                if file:
                    folder = (out_dir / file).parent.resolve()
                    if folder.parent == out_dir.resolve():  # never outside out_dir
                        folders.add(folder)
    return folders


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    """An empty output folder, or refuse: a second ingest into the same folder would mix two
    manifests' images. With `overwrite`, a previous ingest's folders and manifest are removed
    (files it did not write are left alone)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputNotEmpty(f"{out_dir} is a file, not a folder")
    entries = list(out_dir.iterdir()) if out_dir.is_dir() else []
    if not entries:
        return
    if not overwrite:
        what = (
            "a previous ingest (manifest.jsonl)"
            if (out_dir / MANIFEST).exists()
            else f"{len(entries)} entries"
        )
        raise OutputNotEmpty(f"--out {out_dir} is not empty: it holds {what}")
    for folder in manifest_folders(out_dir):
        shutil.rmtree(folder, ignore_errors=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)


def export_sources(
    paths: list[Path],
    out_dir: Path,
    options: IngestOptions,
    count_tokens: TokenCounter,
    on_source: Callable[[Path, int, str | None], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Write images under out_dir/<source>/ and one manifest line per unit (or per failed source);
    `on_source(path, images written, error)` hears of each source as it is done."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / MANIFEST, "w") as manifest:
        for path in expand_paths(paths):
            images, error = 0, None
            for record in _export_one(path, out_dir, options, count_tokens):
                manifest.write(json.dumps(record) + "\n")
                if record.get("file"):
                    images += 1
                elif "unit" not in record:
                    error = record.get("error")
                yield record
            if on_source is not None:
                on_source(path, images, error)


def _export_one(
    path: Path, out_dir: Path, options: IngestOptions, count_tokens: TokenCounter
) -> Iterator[dict[str, Any]]:
    source = str(path)
    folder = out_dir / folder_name(path)
    try:
        info = inspect_source(path)
        name = "frame" if info.kind == "video" else "page" if info.kind == "pdf" else "image"
        for item in split_source(path, info.kind, options):
            base = {"source": source, "kind": info.kind, "unit": item.index, "timestamp": item.timestamp}
            if isinstance(item, UnitFailure):
                yield {**base, "error": item.message}
                continue
            folder.mkdir(exist_ok=True)  # on the first image: a failed source leaves no empty folder
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
