"""Turn one source into its units (pages, frames, or the single image) per the job's options."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ingest.images import load_image
from ingest.limits import Limits
from ingest.pdf import pdf_page_indices, render_pdf_pages
from ingest.spec import IngestOptions
from ingest.units import RenderedImage, SourceError, SourceKind, UnitFailure, UnitSelection
from ingest.video import sample_video_frames

DEFAULT_LIMITS = Limits()


def split_source(
    path: Path,
    kind: SourceKind,
    options: IngestOptions,
    limits: Limits = DEFAULT_LIMITS,
    selection: UnitSelection | None = None,
    shard: tuple[int, int] | None = None,
) -> Iterator[RenderedImage | UnitFailure]:
    """Yield the units of ``path`` (of ``kind``, from ``ingest.detect.detect_kind``).

    Raises SourceError when the whole source is unreadable; per-unit problems are yielded
    as UnitFailure so the other pages or frames go on. For a PDF, ``selection`` picks a range of
    its pages (videos are split whole) and ``shard=(k, n)`` yields the k-th of every n of them:
    ingest.spread runs n processes over one document.
    """
    if shard is not None and kind != "pdf":
        raise ValueError("only the pages of a PDF are split over processes")
    path = Path(path)
    if kind == "pdf":
        yield from render_pdf_pages(
            path,
            longest_side=options.longest_side,
            dpi=options.dpi,
            pages=options.pages,
            max_pages=limits.max_pdf_pages,
            max_render_pixels=limits.max_render_pixels,
            selection=selection,
            shard=shard,
        )
    elif kind == "video":
        yield from sample_video_frames(
            path,
            fps=options.fps,
            max_frames=options.max_frames,
            num_frames=options.num_frames,
            max_seconds=limits.max_video_seconds,
            keyframes=options.keyframes,
        )
    elif kind == "image":
        yield load_image(path, max_pixels=limits.max_image_pixels)
    else:
        raise SourceError(f"unsupported source kind {kind!r}")


def planned_units(
    path: Path, kind: SourceKind, options: IngestOptions, limits: Limits = DEFAULT_LIMITS
) -> int | None:
    """How many units a source has before any selection: a PDF's selected pages; None for the rest
    (a video is split whole, an image is one unit)."""
    if kind == "pdf":
        return len(pdf_page_indices(path, pages=options.pages, max_pages=limits.max_pdf_pages))
    return None
