"""Render PDF pages to upright RGB images, with their text layer, using PyMuPDF."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

from ingest.mupdf import pymupdf
from ingest.spec import PAGE_RANGE_ITEM
from ingest.units import RenderedImage, SourceError, UnitFailure, UnitSelection

DEFAULT_LONGEST_SIDE = 1288
# One page render is width * height * 3 bytes; 50 MP is 150 MB. A page with an absurd
# MediaBox (some CAD exports are metres wide) or a high DPI on a poster would otherwise ask
# MuPDF for gigabytes. Past the cap the zoom is lowered, so such pages come out smaller.
MAX_RENDER_PIXELS = 50_000_000
POINTS_PER_INCH = 72.0

_RANGE_ITEM = PAGE_RANGE_ITEM


def parse_page_ranges(spec: str, page_count: int) -> list[int]:
    """Turn "1-3,7" (1-based, inclusive) into sorted, distinct 0-based page indices.

    "5-" runs to the last page. Bad syntax, page 0, a reversed range or a page past the
    end raises SourceError naming the problem.
    """
    items = spec.split(",")
    if not spec.strip():
        raise SourceError("empty page range")
    chosen: set[int] = set()
    for item in items:
        match = _RANGE_ITEM.match(item)
        if match is None:
            raise SourceError(f"bad page range {item.strip()!r} in {spec!r} (expected e.g. '1-3,7')")
        first = int(match.group(1))
        if match.group(2) is None:
            last = first
        elif match.group(3):
            last = int(match.group(3))
        else:
            last = page_count
        if first < 1:
            raise SourceError(f"bad page range {item.strip()!r}: pages are numbered from 1")
        if last < first:
            raise SourceError(f"bad page range {item.strip()!r}: the end is before the start")
        if last > page_count:
            raise SourceError(
                f"page {last} is out of range (the PDF has {page_count} page{'s' if page_count != 1 else ''})"
            )
        chosen.update(range(first - 1, last))
    return sorted(chosen)


def pdf_page_indices(path: Path, *, pages: str | None = None, max_pages: int | None = None) -> list[int]:
    """The 0-based pages that ``render_pdf_pages`` renders with these options, in order.

    Raises SourceError as it would (unreadable, encrypted, no pages, bad range, over the limit):
    whoever spreads the pages over processes checks the document once, before starting any.
    """
    doc = _open_pdf(Path(path))
    try:
        return _selected_pages(doc, pages, max_pages)
    finally:
        doc.close()


def render_pdf_pages(
    path: Path,
    *,
    longest_side: int | None = DEFAULT_LONGEST_SIDE,
    dpi: int | None = None,
    pages: str | None = None,
    max_pages: int | None = None,
    max_render_pixels: int = MAX_RENDER_PIXELS,
    selection: UnitSelection | None = None,
    shard: tuple[int, int] | None = None,
) -> Iterator[RenderedImage | UnitFailure]:
    """Yield each selected page as RGB, its longest side ``longest_side`` px (or at ``dpi``).

    ``dpi`` wins when both are given. Page rotation (/Rotate) is applied. A page that fails
    yields a UnitFailure and the next page goes on; a document that cannot be opened at all
    raises SourceError (on the first ``next()``, as this is a generator). ``selection``
    narrows the pages to a range (and leaves out pages already stored); ``shard=(k, n)`` then
    renders only the k-th of every n of them (the k-th of n processes, ingest.spread).
    """
    doc = _open_pdf(Path(path))
    try:
        indices = _selected_pages(doc, pages, max_pages)
        if selection is not None:
            indices = selection.pick(indices)
        if shard is not None:
            first, step = shard
            indices = indices[first::step]
        for index in indices:
            yield _render_page(doc, index, longest_side=longest_side, dpi=dpi, max_pixels=max_render_pixels)
    finally:
        doc.close()


def _selected_pages(doc: pymupdf.Document, pages: str | None, max_pages: int | None) -> list[int]:
    indices = parse_page_ranges(pages, doc.page_count) if pages is not None else list(range(doc.page_count))
    if max_pages is not None and len(indices) > max_pages:
        raise SourceError(
            f"{len(indices)} pages selected, over the limit of {max_pages} "
            "(choose a range with --pages, or raise VISBATCH_LIMIT_MAX_PDF_PAGES)"
        )
    return indices


def _open_pdf(path: Path) -> pymupdf.Document:
    try:
        # filetype="pdf": MuPDF otherwise picks its parser from the file name, and names lie.
        doc = pymupdf.open(str(path), filetype="pdf")
    except pymupdf.FileNotFoundError as exc:
        raise SourceError("file not found") from exc
    except Exception as exc:
        raise SourceError(f"cannot open PDF (corrupt, truncated or not a PDF): {exc}") from exc
    try:
        # An empty user password is common ("protected" against printing or copying only):
        # such files open for reading without asking anybody for anything.
        if doc.needs_pass and not doc.authenticate(""):
            raise SourceError("encrypted PDF (needs a password)")
        if doc.page_count == 0:
            raise SourceError("PDF has no pages")
    except SourceError:
        doc.close()
        raise
    except Exception as exc:
        doc.close()
        raise SourceError(f"cannot read PDF: {exc}") from exc
    return doc


def _render_page(
    doc: pymupdf.Document, index: int, *, longest_side: int | None, dpi: int | None, max_pixels: int
) -> RenderedImage | UnitFailure:
    try:
        page = doc.load_page(index)
        # page.rect is the CropBox *after* /Rotate, so a portrait page rotated by 90 degrees
        # is already landscape here, and get_pixmap renders it rotated.
        rect = page.rect
        if rect.width <= 0 or rect.height <= 0:
            return UnitFailure(index, f"page {index + 1} has zero size")
        target = None if dpi is not None else (longest_side or DEFAULT_LONGEST_SIDE)
        zoom = _zoom(rect.width, rect.height, longest_side=target, dpi=dpi, max_pixels=max_pixels)
        pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), colorspace=pymupdf.csRGB, alpha=False)
        if pix.width == 0 or pix.height == 0:
            return UnitFailure(index, f"page {index + 1} renders to an empty image")
        image = Image.frombytes("RGB", (pix.width, pix.height), pix.samples, "raw", "RGB", pix.stride)
    except Exception as exc:
        return UnitFailure(index, f"page {index + 1} failed to render: {exc}")
    if target is not None:
        image = _exact_longest_side(image, target)
    return RenderedImage(index=index, image=image, text=_page_text(page))


def _zoom(
    width: float,
    height: float,
    *,
    longest_side: int | None,
    dpi: int | None,
    max_pixels: int = MAX_RENDER_PIXELS,
) -> float:
    """Scale from PDF points to pixels, lowered if needed to stay under `max_pixels`."""
    zoom = dpi / POINTS_PER_INCH if dpi is not None else (longest_side or 0) / max(width, height)
    cap = math.sqrt(max_pixels / (width * height))
    return min(zoom, cap)


def _exact_longest_side(image: Image.Image, target: int) -> Image.Image:
    # MuPDF rounds the pixmap box outwards, which can leave the longest side one pixel off;
    # callers rely on the exact size (it decides the token count), so fix that pixel.
    # Images smaller than the target were capped by MAX_RENDER_PIXELS: leave them.
    longest = max(image.size)
    if longest == target or abs(longest - target) > 2:
        return image
    scale = target / longest
    size = tuple(max(1, round(side * scale)) for side in image.size)
    return image.resize(size, Image.Resampling.LANCZOS)


def _page_text(page: pymupdf.Page) -> str | None:
    # The text layer is a bonus for prompts; a page whose text extraction breaks still renders.
    try:
        return page.get_text()
    except Exception:
        return None
