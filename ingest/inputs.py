"""Which files a job takes: files named on the command line, and the documents in walked folders.

A file named explicitly is always taken (a text file named ``scan.pdf`` then fails on its own
source, with the reason). A folder is walked (sorted, hidden entries skipped) and contributes the
files that are plainly documents: a PDF, video or image extension, or a PDF, image or video
container signature in their first bytes. Everything else (a README, a script, a licence next to
the scans) is skipped and counted, rather than ending the job `partial` with one error per stray
file. ``--include`` / ``--exclude`` globs replace that guess when it is wrong.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ingest.detect import HEAD_BYTES, PDF_MAGIC, PDF_MAGIC_WINDOW, _is_image, _looks_like_media

# Extensions of what visbatch reads (PDF, the video containers FFmpeg opens, the image formats).
DOCUMENT_EXTENSIONS = frozenset(
    [
        "pdf",
        "png",
        "jpg",
        "jpeg",
        "jpe",
        "webp",
        "tif",
        "tiff",
        "gif",
        "bmp",
        "mp4",
        "m4v",
        "mov",
        "mkv",
        "webm",
        "avi",
        "mpg",
        "mpeg",
        "mpe",
        "ts",
        "mts",
        "m2ts",
        "wmv",
        "asf",
        "flv",
        "ogv",
        "ogg",
        "3gp",
        "3g2",
        "mxf",
        "dv",
        "vob",
        "y4m",
    ]
)


@dataclass
class InputSelection:
    """The files of a job, in order, and the walked files left out (with why)."""

    files: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)  # not documents (by name and content)
    excluded: list[Path] = field(default_factory=list)  # left out by --include / --exclude
    missing: list[Path] = field(default_factory=list)  # named on the command line, not there

    def refusal(self, given: Sequence[Path]) -> tuple[str, str] | None:
        """Why no job can start from these inputs, as (what, the fix), or None: a path that does
        not exist, or not one file. The command line and the Python API say it in these words
        (the one a UserError with exit 2, the other a visbatch.Error)."""
        if self.missing:
            names = ", ".join(str(p) for p in self.missing[:5])
            return f"no such file or folder: {names}", "check the path (folders are walked)"
        if not self.files:
            shown = ", ".join(str(p) for p in given[:5])
            left = len(self.skipped) + len(self.excluded)
            detail = f"; {left} file(s) left out by the filters or as not documents" if left else ""
            return (
                f"no input files found in {shown}{detail}",
                "give PDFs, videos or images, or folders holding them (--include GLOB picks other files)",
            )
        return None

    def describe_skipped(self, limit: int = 5) -> str | None:
        """One line about the walked files not taken, or None when there were none."""
        if not self.skipped:
            return None
        names = ", ".join(p.name for p in self.skipped[:limit])
        more = f" and {len(self.skipped) - limit} more" if len(self.skipped) > limit else ""
        return (
            f"skipped {len(self.skipped)} file(s) in the folders given that are not PDFs, videos or "
            f"images: {names}{more} (--include GLOB takes them)"
        )


def looks_like_document(path: Path) -> bool:
    """A PDF, video or image by its extension or its first bytes (not a full detection)."""
    if path.suffix.lower().lstrip(".") in DOCUMENT_EXTENSIONS:
        return True
    try:
        with path.open("rb") as handle:
            head = handle.read(HEAD_BYTES)
    except OSError:
        return True  # unreadable: let the job say so on its source
    if not head:
        return False
    return _is_image(head) or PDF_MAGIC in head[:PDF_MAGIC_WINDOW] or _looks_like_media(head)


def _matches(path: Path, root: Path, globs: Sequence[str]) -> bool:
    relative = path.relative_to(root).as_posix()
    return any(fnmatch.fnmatch(relative, g) or fnmatch.fnmatch(path.name, g) for g in globs)


def select_inputs(
    paths: Sequence[Path], include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> InputSelection:
    """Files as given, folders walked and filtered (see the module doc); duplicates removed."""
    selection = InputSelection()
    seen: set[Path] = set()

    def take(path: Path, bucket: list[Path]) -> None:
        key = path.resolve() if path.exists() else path
        if key not in seen:
            seen.add(key)
            bucket.append(key)

    for path in paths:
        path = Path(path)
        if not path.is_dir():
            take(path, selection.files if path.exists() else selection.missing)
            continue
        for child in sorted(path.rglob("*")):
            rel = child.relative_to(path)
            if not child.is_file() or any(part.startswith(".") for part in rel.parts):
                continue
            if exclude and _matches(child, path, exclude):
                take(child, selection.excluded)
            elif include:
                take(child, selection.files if _matches(child, path, include) else selection.excluded)
            elif looks_like_document(child):
                take(child, selection.files)
            else:
                take(child, selection.skipped)
    return selection
