"""Benchmark inputs, generated from code and cached under bench/.cache (never committed).

A report-like PDF (text, a table, a vector chart: what invoices and papers are made of, so the
renderers do real work) and H.264 videos with a keyframe every 2 s (a common encoder setting)
or sparser (phone and screen recordings: 8 s and more).
Every page and frame differs from the others, so no image is deduplicated by content.
"""

from __future__ import annotations

import random
from pathlib import Path

import av
import numpy as np
import pymupdf

CACHE = Path(__file__).resolve().parent / ".cache"
A4 = (595, 842)  # points
WORDS = str.split(
    "invoice total amount due vendor payment order quantity price tax net gross delivery "
    "terms account number reference date period balance credit debit statement summary "
    "report quarter revenue margin cost growth forecast region product service contract"
)


def cache_dir(*parts: str) -> Path:
    path = CACHE.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def report_pdf(pages: int, *, variant: str = "") -> Path:
    """A `pages`-page report; `variant` changes every page's text (distinct pixels per variant)."""
    path = cache_dir("pdf") / f"report-{pages}{'-' + variant if variant else ''}.pdf"
    if path.exists():
        return path
    rng = random.Random(f"{pages}-{variant}")
    doc = pymupdf.open()
    for n in range(pages):
        _report_page(doc.new_page(width=A4[0], height=A4[1]), n, rng, variant)
    tmp = path.with_suffix(".tmp")
    doc.save(str(tmp), garbage=3, deflate=True)
    doc.close()
    tmp.rename(path)
    return path


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _report_page(page: pymupdf.Page, n: int, rng: random.Random, variant: str) -> None:
    # One Shape per page: committing each drawing separately costs ~100 ms a page.
    shape = page.new_shape()
    shape.insert_text((50, 60), f"Quarterly report {variant} - page {n + 1}", fontsize=18, fontname="hebo")
    body = " ".join(_sentence(rng, rng.randint(8, 16)) for _ in range(14))
    shape.insert_textbox(pymupdf.Rect(50, 80, 545, 330), body, fontsize=10, fontname="helv")
    # A table: header band, grid lines, numbers.
    top, cols = 350, [50, 230, 310, 390, 470, 545]
    shape.draw_rect(pymupdf.Rect(cols[0], top, cols[-1], top + 18))
    shape.finish(color=None, fill=(0.85, 0.88, 0.95))
    for row in range(12):
        y = top + 18 * (row + 1)
        shape.draw_line((cols[0], y), (cols[-1], y))
        shape.finish(color=(0.6, 0.6, 0.6), width=0.5)
        for c in range(len(cols) - 1):
            cell = rng.choice(WORDS) if c == 0 else f"{rng.uniform(0, 9999):,.2f}"
            shape.insert_text((cols[c] + 4, y - 5), cell, fontsize=8)
    # A bar chart drawn with vectors.
    base = 770
    for i in range(16):
        height = rng.uniform(20, 150)
        x = 60 + i * 30
        shape.draw_rect(pymupdf.Rect(x, base - height, x + 20, base))
        shape.finish(color=None, fill=(0.2 + 0.04 * i, 0.4, 0.8 - 0.04 * i))
    shape.draw_line((55, base), (545, base))
    shape.finish(color=(0, 0, 0), width=1)
    shape.insert_text((50, 800), _sentence(rng, 12), fontsize=9, fontname="helv")
    shape.commit()


def video(seconds: int, size: tuple[int, int] = (640, 360), fps: int = 25, gop_seconds: float = 2.0) -> Path:
    """An H.264 (libx264) video; keyframe every `gop_seconds`; moving shapes so P-frames carry data."""
    width, height = size
    extra = (f"-{fps}fps" if fps != 25 else "") + (f"-gop{gop_seconds:g}s" if gop_seconds != 2.0 else "")
    path = cache_dir("video") / f"clip-{seconds}s-{width}x{height}{extra}.mp4"
    if path.exists():
        return path
    tmp = path.with_name(path.stem + ".tmp.mp4")
    ys, xs = np.mgrid[0:height, 0:width]
    with av.open(str(tmp), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = int(fps * gop_seconds)
        stream.codec_context.options = {"preset": "superfast", "sc_threshold": "0"}
        for i in range(int(seconds * fps)):
            frame = np.empty((height, width, 3), dtype=np.uint8)
            frame[..., 0] = (xs + 3 * i) % 256
            frame[..., 1] = (ys + 2 * i) % 256
            frame[..., 2] = (i * 5) % 256
            x = (i * 7) % max(1, width - 60)
            frame[height // 3 : height // 3 + 60, x : x + 60] = (255, 255, 255)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tmp.rename(path)
    return path
