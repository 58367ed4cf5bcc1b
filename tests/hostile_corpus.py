"""A corpus of broken and hostile inputs, generated at test time (nothing binary is shipped)."""

from __future__ import annotations

import io
import random
import zipfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pymupdf
from PIL import Image

from tests.media import ZERO_PAGE_PDF, write_audio_only, write_encrypted_pdf, write_pdf, write_video

# A page tree whose /Kids points back at itself.
PAGE_TREE_LOOP_PDF = (
    b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
    b"2 0 obj<</Type/Pages/Kids[2 0 R]/Count 1>>endobj\n"
    b"trailer<</Root 1 0 R>>\n%%EOF\n"
)


def _flip_bits(data: bytes, n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    out = bytearray(data)
    for _ in range(n):
        pos = rng.randrange(len(out) // 4, len(out))  # spare the header: exercise the parsers
        out[pos] ^= 1 << rng.randrange(8)
    return bytes(out)


def _empty_user_password_pdf(path: Path) -> Path:
    doc = pymupdf.open()
    doc.new_page().insert_text((72, 72), "readable, but not printable")
    doc.save(str(path), encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw="owner", user_pw="",
             permissions=pymupdf.PDF_PERM_ACCESSIBILITY)  # fmt: skip
    doc.close()
    return path


def _huge_mediabox_pdf(path: Path) -> Path:
    doc = pymupdf.open()
    page = doc.new_page(width=14_400, height=14_400)  # 200 x 200 inches, PDF's largest
    page.insert_text((72, 72), "a poster")
    doc.save(str(path))
    doc.close()
    return path


def _zero_frame_video(path: Path, source: bytes) -> Path:
    """A Matroska file cut just before its first Cluster: headers and a video track, no frames."""
    cluster = source.find(b"\x1f\x43\xb6\x75")
    path.write_bytes(source[:cluster])
    return path


def _vfr_video(path: Path) -> Path:
    """Frames at irregular times (variable frame rate)."""
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1000)
        pts = 0
        for i in range(40):
            frame = av.VideoFrame.from_ndarray(np.full((120, 160, 3), i * 6, dtype=np.uint8), format="rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, 1000)
            pts += 20 if i % 3 else 250
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _rotated_video(path: Path) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 160, 96, "yuv420p"
        stream.set_display_rotation(90)
        frames = [np.full((96, 160, 3), 12 * i, dtype=np.uint8) for i in range(20)]
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _png_bomb(path: Path) -> Path:
    """A 1-bit 30,000 x 30,000 PNG: a few KB on disk, 2.7 GB as RGB."""
    Image.new("1", (30_000, 30_000)).save(path, optimize=True)
    return path


def _exif_rotated_jpeg(path: Path) -> Path:
    image = Image.new("RGB", (200, 100), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    image.save(path, format="JPEG", exif=exif)
    return path


def write_corpus(folder: Path) -> dict[str, str]:
    """Write every hostile input; returns {file name: what must happen} ('ok', 'source', 'unit')."""
    folder.mkdir(parents=True, exist_ok=True)
    good_pdf = write_pdf(folder / "good.pdf", pages=2).read_bytes()
    good_mp4 = write_video(folder / "good.mp4", seconds=2).read_bytes()
    mkv = folder / "good.mkv"
    with av.open(str(mkv), "w", format="matroska") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 160, 120, "yuv420p"
        for i in range(20):
            for p in s.encode(
                av.VideoFrame.from_ndarray(np.full((120, 160, 3), i, dtype=np.uint8), format="rgb24")
            ):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    _zero_frame_video(folder / "zero-frames.mkv", mkv.read_bytes())
    zip_bytes = io.BytesIO()
    with zipfile.ZipFile(zip_bytes, "w") as z:
        z.writestr("a.txt", "hello")
    files = {
        "truncated.pdf": good_pdf[: len(good_pdf) // 3],
        "bitflip.pdf": _flip_bits(good_pdf, 40, seed=1),
        "zero-pages.pdf": ZERO_PAGE_PDF,
        "page-tree-loop.pdf": PAGE_TREE_LOOP_PDF,
        "html.pdf": b"<!DOCTYPE html><html><body>not a pdf</body></html>\n",
        "zip.pdf": zip_bytes.getvalue(),
        "truncated.mp4": good_mp4[: len(good_mp4) // 2],
        "bitflip.mp4": _flip_bits(good_mp4, 60, seed=2),
        "truncated.mkv": mkv.read_bytes()[: mkv.stat().st_size // 2],
        "bitflip.mkv": _flip_bits(mkv.read_bytes(), 60, seed=3),
        "empty.jpg": b"",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    mkv.unlink()
    write_encrypted_pdf(folder / "encrypted.pdf")
    _empty_user_password_pdf(folder / "empty-user-password.pdf")
    _huge_mediabox_pdf(folder / "huge-mediabox.pdf")
    write_audio_only(folder / "audio-only.mp4")
    _vfr_video(folder / "vfr.mkv")
    _rotated_video(folder / "rotated.mp4")
    Image.new("CMYK", (120, 80), (0, 200, 200, 0)).save(folder / "cmyk.jpg")
    Image.fromarray(np.arange(0, 65536, 16, dtype=np.uint16).reshape(64, 64)).save(folder / "16bit.png")
    _exif_rotated_jpeg(folder / "exif-rotated.jpg")
    Image.new("RGB", (1, 100_000)).save(folder / "1x100000.png")
    _png_bomb(folder / "bomb.png")
    return {
        "good.pdf": "ok", "good.mp4": "ok", "empty-user-password.pdf": "ok", "huge-mediabox.pdf": "ok",
        "vfr.mkv": "ok", "rotated.mp4": "ok", "cmyk.jpg": "ok", "16bit.png": "ok", "exif-rotated.jpg": "ok",
        "1x100000.png": "unit",
        "bitflip.pdf": "any", "bitflip.mp4": "any", "bitflip.mkv": "any", "truncated.mp4": "any",
        "truncated.mkv": "any", "truncated.pdf": "any",
        "zero-pages.pdf": "source", "page-tree-loop.pdf": "any", "html.pdf": "source", "zip.pdf": "source",
        "empty.jpg": "source", "encrypted.pdf": "source", "audio-only.mp4": "source",
        "zero-frames.mkv": "source", "bomb.png": "source",
    }  # fmt: skip
