"""What a source will become, without rendering or decoding it: for `visbatch plan`.

PDF: the page count and each page's size in points (PyMuPDF, no rendering), turned into the
pixel size the renderer would produce with the job's options. Video: the duration from the
headers (or from demuxing packets, never decoding), the sampled-frame count from the same
``plan_targets`` ingest uses, and the upright frame size from decoding ONE frame. Image: the
header size, turned by its EXIF orientation.

This runs in the calling process (the user's own files, a CLI); the worker's ingest still runs
every source in its sandboxed child.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from ingest import pdf as pdf_mod
from ingest import video as video_mod
from ingest.detect import detect_kind
from ingest.limits import Limits
from ingest.mupdf import pymupdf
from ingest.spec import IngestOptions
from ingest.units import SourceError

# EXIF orientations that swap width and height (transpose, 90 and 270 degrees, transverse).
_SWAPPING_ORIENTATIONS = {5, 6, 7, 8}


@dataclass
class SourceSurvey:
    path: Path
    kind: str | None
    sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) per page/frame/image
    duration: float | None = None  # video, seconds
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def survey_source(path: Path, options: IngestOptions, limits: Limits | None = None) -> SourceSurvey:
    """Sizes of the units `path` will give under `options`; errors are reported, not raised."""
    limits = limits or Limits()
    try:
        kind = detect_kind(path)
    except SourceError as exc:
        return SourceSurvey(path, None, error=str(exc))
    try:
        if kind == "pdf":
            return _pdf(path, options, limits)
        if kind == "video":
            return _video(path, options)
        return _image(path)
    except SourceError as exc:
        return SourceSurvey(path, kind, error=str(exc))


def pdf_page_size(
    width_pt: float, height_pt: float, options: IngestOptions, max_render_pixels: int
) -> tuple[int, int]:
    """The pixel size ingest renders a page of this size (in points) to, computed, not rendered."""
    target = None if options.dpi is not None else (options.longest_side or pdf_mod.DEFAULT_LONGEST_SIDE)
    zoom = pdf_mod._zoom(
        width_pt, height_pt, longest_side=target, dpi=options.dpi, max_pixels=max_render_pixels
    )
    box = (pymupdf.Rect(0, 0, width_pt, height_pt) * pymupdf.Matrix(zoom, zoom)).irect
    width, height = box.width, box.height
    if target is not None:  # as pdf._exact_longest_side fixes MuPDF's outward rounding
        longest = max(width, height)
        if longest != target and abs(longest - target) <= 2:
            scale = target / longest
            width, height = (max(1, round(side * scale)) for side in (width, height))
    return width, height


def _pdf(path: Path, options: IngestOptions, limits: Limits) -> SourceSurvey:
    doc = pdf_mod._open_pdf(path)
    try:
        indices = (
            pdf_mod.parse_page_ranges(options.pages, doc.page_count)
            if options.pages is not None
            else range(doc.page_count)
        )
        survey = SourceSurvey(path, "pdf")
        for index in indices:
            rect = doc.load_page(index).rect  # the CropBox after /Rotate, as the renderer sees it
            if rect.width <= 0 or rect.height <= 0:
                survey.notes.append(f"page {index + 1} has zero size (ingest fails it)")
                continue
            survey.sizes.append(pdf_page_size(rect.width, rect.height, options, limits.max_render_pixels))
        return survey
    finally:
        doc.close()


def planned_frame_count(duration: float, rate: float | None, options: IngestOptions) -> int:
    """Frames ingest samples: its own target times, two landing on one frame counted once."""
    targets = video_mod.plan_targets(
        duration, fps=options.fps, max_frames=options.max_frames, num_frames=options.num_frames
    )
    if not rate:
        return len(targets)
    return len({round(t * rate) for t in targets})


def _video(path: Path, options: IngestOptions) -> SourceSurvey:
    container = video_mod._open(path)
    try:
        stream = video_mod._video_stream(container)
        duration = video_mod._header_duration(container, stream)
        rate = stream.average_rate or stream.guessed_rate
        first = None
        for frame in container.decode(stream):  # one frame: its upright size
            first = frame
            break
        if first is None:
            raise SourceError("video has no decodable frames")
        width, height = video_mod.upright_image(first, stream.metadata.get("rotate")).size
    except SourceError:
        container.close()
        raise
    except Exception as exc:
        container.close()
        raise SourceError(f"cannot read video: {exc}") from exc
    container.close()
    if duration is None:
        duration = video_mod._duration_by_demux(path)
    count = planned_frame_count(duration, float(rate) if rate else None, options)
    return SourceSurvey(path, "video", sizes=[(width, height)] * count, duration=duration)


def _image(path: Path) -> SourceSurvey:
    try:
        with Image.open(path) as img:
            width, height = img.size
            orientation = img.getexif().get(0x0112)
    except Exception as exc:
        raise SourceError(f"not a readable image: {exc}") from exc
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    return SourceSurvey(path, "image", sizes=[(width, height)])
