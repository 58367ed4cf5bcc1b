"""Small media files generated in tests (no binaries shipped): videos with PyAV, PDFs with PyMuPDF."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pymupdf


def write_video(path: Path, *, seconds: float = 3, size: tuple[int, int] = (320, 240), fps: int = 10) -> Path:
    """A video with a moving square and a changing background, so frames differ."""
    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(int(seconds * fps)):
            frame = np.full((height, width, 3), (i * 7) % 255, dtype=np.uint8)
            x = (i * 9) % max(1, width - 40)
            frame[40:80, x : x + 40] = (255, 0, 0)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_pdf(path: Path, pages: int = 2, text: str = "Invoice total: 1234.50 EUR") -> Path:
    doc = pymupdf.open()
    for n in range(pages):
        page = doc.new_page(width=595, height=842)
        page.insert_text((72, 72), f"{text} (page {n + 1})", fontsize=14)
        page.draw_rect(pymupdf.Rect(72, 100 + 20 * n, 300, 200 + 20 * n), color=(0, 0, 1), fill=(0.9, 0.9, 1))
    doc.save(str(path))
    doc.close()
    return path


def write_audio_only(path: Path, seconds: float = 1.0) -> Path:
    """An MP4 with an audio stream and no video stream."""
    rate = 16000
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate)
        samples = np.zeros((1, 1024), dtype=np.float32)
        for i in range(int(seconds * rate / 1024)):
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate = rate
            frame.pts = i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_encrypted_pdf(path: Path, user_password: str = "secret") -> Path:
    doc = pymupdf.open()
    doc.new_page().insert_text((72, 72), "confidential")
    doc.save(str(path), encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw="owner", user_pw=user_password)
    doc.close()
    return path


# A syntactically valid PDF whose page tree has no pages (PyMuPDF refuses to save one).
ZERO_PAGE_PDF = (
    b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
    b"2 0 obj<</Type/Pages/Kids[]/Count 0>>endobj\n"
    b"trailer<</Root 1 0 R>>\n%%EOF\n"
)


def write_bad_inputs(folder: Path) -> dict[str, Path]:
    """Every kind of broken source the pipeline must survive, by name."""
    folder.mkdir(parents=True, exist_ok=True)
    good_pdf = write_pdf(folder / "_tmp_good.pdf", pages=3)
    good_video = write_video(folder / "_tmp_good.mp4", seconds=2)
    bad = {
        "truncated.pdf": good_pdf.read_bytes()[:400],
        "text.pdf": b"this is a plain text file, not a PDF\n" * 10,
        "zero-pages.pdf": ZERO_PAGE_PDF,
        "truncated.mp4": good_video.read_bytes()[: good_video.stat().st_size // 3],
        "empty.png": b"",
    }
    good_pdf.unlink()
    good_video.unlink()
    paths = {}
    for name, data in bad.items():
        (folder / name).write_bytes(data)
        paths[name] = folder / name
    paths["encrypted.pdf"] = write_encrypted_pdf(folder / "encrypted.pdf")
    paths["audio-only.mp4"] = write_audio_only(folder / "audio-only.mp4")
    return paths


def slow_shapes() -> pymupdf.Document:
    """A one-page PDF of thousands of translucent vector shapes: ~0.1 s to render at 448 px. Drawn
    once, it is shown on any number of pages as a form (`page.show_pdf_page`): each page still
    renders all of the shapes, but writing 100 pages takes about a second, not the minute that
    drawing them page by page took (issue 20). The caller closes it."""
    shapes = pymupdf.open()
    template = shapes.new_page(width=595, height=842)
    shape = template.new_shape()
    for i in range(3000):
        shape.draw_circle(((i * 37) % 560 + 10, (i * 53) % 820 + 10), 3 + i % 5)
    shape.finish(color=(0, 0, 1), fill=(0.5, 0.2, 0.1), fill_opacity=0.3)
    shape.commit()
    return shapes


def write_slow_pdf(path: Path, pages: int) -> Path:
    """Pages of `slow_shapes()`, so a test can act while a source is still being split (image
    sizes, and so encode cost, stay small); each page's own "page N" makes its image its own."""
    shapes = slow_shapes()
    doc = pymupdf.open()
    for n in range(pages):
        page = doc.new_page(width=595, height=842)
        page.show_pdf_page(page.rect, shapes, 0)
        page.insert_text((72, 72), f"page {n + 1}")
    doc.save(str(path))
    doc.close()
    shapes.close()
    return path
