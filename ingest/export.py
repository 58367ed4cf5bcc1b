"""`visbatch ingest`: the ingest stage alone, writing page and frame images and a manifest to a folder.

The output folder is replaced as a whole, never patched: everything is written to a staging
folder beside it, which takes its place once every source is done. So OUT holds one complete
ingest (its manifest lists exactly its images) or is left as it was, when the run fails or is
interrupted: never the images of one run under the manifest of another. A source gets its
folder with its first image, so a source that fails leaves none.

Pages and frames are split by the same code as a job's ingest (ingest.spread, ingest.split);
the pages of one PDF are rendered by ``processes`` processes, and each image is written by the
process that rendered it, with the one image writer (ingest.image_file).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from ingest.detect import detect_kind
from ingest.image_file import IMAGE_SUFFIX, write_image
from ingest.limits import Limits
from ingest.spec import IngestOptions
from ingest.split import DEFAULT_LIMITS
from ingest.spread import spread_units
from ingest.stage import check_source, expand_paths
from ingest.units import RenderedImage, SourceError, SourceKind, UnitFailure

MANIFEST = "manifest.jsonl"
UNIT_NAMES = {"pdf": "page", "video": "frame", "image": "image"}
TokenCounter = Callable[[int, int], int]  # (width, height) -> visual tokens; ValueError if refused

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class OutputFolderError(Exception):
    """OUT cannot be used (not empty without overwrite, not a folder, not an ingest output)."""


def folder_name(path: Path) -> str:
    """A safe, unique folder name per source: sanitized stem plus a short hash of the full path."""
    stem = _UNSAFE.sub("_", path.stem).strip("._")[:60] or "source"
    return f"{stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def check_output_folder(out_dir: Path, overwrite: bool) -> None:
    """Raise OutputFolderError unless OUT is absent, empty, or (with overwrite) a previous ingest."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputFolderError(f"--out {out_dir} exists and is not a folder")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise OutputFolderError(
            f"--out {out_dir} is not empty; add --overwrite to replace it, or choose another folder"
        )
    if not (out_dir / MANIFEST).is_file():
        raise OutputFolderError(
            f"--out {out_dir} is not empty and holds no {MANIFEST}: not a visbatch ingest output, "
            "so --overwrite will not delete it; choose another folder"
        )
    # OUT is replaced whole: it may hold nothing a previous ingest did not write.
    ours = {MANIFEST} | _manifest_folders(out_dir)
    strays = sorted(entry.name for entry in out_dir.iterdir() if entry.name not in ours)
    if strays:
        shown = ", ".join(strays[:3]) + (f" and {len(strays) - 3} more" if len(strays) > 3 else "")
        raise OutputFolderError(
            f"--out {out_dir} holds {shown}, which no ingest wrote: --overwrite would delete it; "
            "move it away or choose another folder"
        )


def _manifest_folders(out_dir: Path) -> set[str]:
    """Names of the per-source folders the manifest in `out_dir` lists files in."""
    folders: set[str] = set()
    with open(out_dir / MANIFEST) as manifest:
        for line in manifest:
            try:
                file = json.loads(line).get("file")
            except (ValueError, AttributeError):
                continue
            if isinstance(file, str) and "/" in file:
                folders.add(file.split("/", 1)[0])
    return folders


def export_sources(
    paths: list[Path],
    out_dir: Path,
    options: IngestOptions,
    count_tokens: TokenCounter | None = None,
    *,
    processes: int = 1,
    overwrite: bool = False,
    limits: Limits = DEFAULT_LIMITS,
) -> Iterator[dict[str, Any]]:
    """Write images under out_dir/<source>/ and one manifest line per unit (or per failed source).

    Yields each manifest record as it is written. OUT is replaced only when the iteration ends;
    closing the iterator early (or an error) leaves OUT as it was. Raises OutputFolderError first
    if OUT cannot be used (see check_output_folder).
    """
    out_dir = Path(out_dir)
    check_output_folder(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(out_dir, "ingest")
    try:
        with open(staging / MANIFEST, "w") as manifest:
            for path in expand_paths(paths):
                for record in _export_one(path, staging, options, count_tokens, processes, limits):
                    manifest.write(json.dumps(record) + "\n")
                    yield record
        _replace(out_dir, staging)
    except BaseException:  # an error, Ctrl-C or an abandoned iterator: OUT stays as it was
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace(out_dir: Path, staging: Path) -> None:
    """Put the staging folder in OUT's place (renames on one file system: no copy)."""
    if out_dir.exists() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    old = _sibling(out_dir, "old")
    out_dir.rename(old / "out")
    staging.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _sibling(out_dir: Path, what: str) -> Path:
    """A new hidden folder beside OUT (same file system, so renames are atomic), made with the
    user's umask (tempfile.mkdtemp would make OUT private to its owner)."""
    path = out_dir.parent / f".{out_dir.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def _export_one(
    path: Path,
    root: Path,
    options: IngestOptions,
    count_tokens: TokenCounter | None,
    processes: int,
    limits: Limits,
) -> Iterator[dict[str, Any]]:
    source = str(path)
    try:
        check_source(path, limits)
        kind = detect_kind(path)  # by content; no hash (a job's ingest needs one, an export not)
        write = partial(_write_unit, root, folder_name(path), source, kind, count_tokens)
        yield from spread_units(path, kind, options, write, limits=limits, processes=processes)
    except SourceError as exc:
        yield {"source": source, "error": str(exc)}
    except OSError as exc:
        yield {"source": source, "error": f"cannot read: {exc.strerror or exc}"}


def _write_unit(
    root: Path,
    folder: str,
    source: str,
    kind: SourceKind,
    count_tokens: TokenCounter | None,
    item: RenderedImage | UnitFailure,
) -> dict[str, Any]:
    """Write one unit's image; its manifest record (runs in the process that made the unit)."""
    base = {"source": source, "kind": kind, "unit": item.index, "timestamp": item.timestamp}
    if kind == "pdf":  # the page as a person reads it (from 1), beside the 0-based unit of SQL
        base["page_number"] = item.index + 1
    if isinstance(item, UnitFailure):
        return {**base, "error": item.message}
    (root / folder).mkdir(exist_ok=True)  # with the first image: a failed source leaves no folder
    file = f"{folder}/{UNIT_NAMES[kind]}-{item.index + 1:05d}{IMAGE_SUFFIX}"
    write_image(item.image, root / file)
    record = {**base, "file": file, "width": item.image.width, "height": item.image.height}
    if count_tokens is not None:
        try:
            record["visual_tokens"] = count_tokens(*item.image.size)
        except ValueError as exc:  # e.g. an aspect ratio the model's resize rule refuses
            record["visual_tokens"] = None
            record["token_error"] = str(exc)
    return {**record, "text": item.text}
