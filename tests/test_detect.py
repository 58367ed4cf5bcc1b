"""detect_kind decides by content: names lie, and non-media gets a clear message."""

from __future__ import annotations

import zipfile
from pathlib import Path

import av
import numpy as np
import pymupdf
import pytest
from PIL import Image

from ingest.detect import detect_kind
from ingest.units import SourceError


def _image(path: Path, fmt: str) -> Path:
    Image.new("RGB", (16, 12), (200, 30, 30)).save(path, format=fmt)
    return path


def _pdf_bytes() -> bytes:
    doc = pymupdf.open()
    doc.new_page().insert_text((50, 50), "hello")
    return doc.tobytes()


def _video(path: Path, frames: int = 10) -> Path:
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height = 32, 32
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 20, np.uint8), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def _audio_only(path: Path, codec: str = "aac") -> Path:
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=44100)
        stream.layout = "mono"
        fmt = "fltp" if codec == "aac" else "s16"
        dtype = np.float32 if codec == "aac" else np.int16
        samples = 1024 if codec == "aac" else 1152
        for i in range(20):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, samples), dtype), format=fmt, layout="mono")
            frame.sample_rate = 44100
            frame.pts = i * samples
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "TIFF", "GIF", "BMP"])
def test_images_by_magic_whatever_the_name(tmp_path: Path, fmt: str) -> None:
    assert detect_kind(_image(tmp_path / "upload.pdf", fmt)) == "image"
    assert detect_kind(_image(tmp_path / "no_extension", fmt)) == "image"


def test_pdf_by_magic_whatever_the_name(tmp_path: Path) -> None:
    path = tmp_path / "photo.png"
    path.write_bytes(_pdf_bytes())
    assert detect_kind(path) == "pdf"


def test_pdf_with_junk_before_the_header(tmp_path: Path) -> None:
    path = tmp_path / "mail.bin"
    path.write_bytes(b"Content-Type: application/pdf\r\n\r\n" + _pdf_bytes())
    assert detect_kind(path) == "pdf"


def test_video_by_content_whatever_the_name(tmp_path: Path) -> None:
    assert detect_kind(_video(tmp_path / "notes.txt")) == "video"


def test_text_named_pdf_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "report.pdf"
    path.write_text("Quarterly report\nRevenue went up.\n")
    with pytest.raises(SourceError, match="not a PDF, video or image") as info:
        detect_kind(path)
    assert "Quarterly" in str(info.value)  # the message shows how the file starts


def test_text_starting_with_bm_is_not_a_bitmap(tmp_path: Path) -> None:
    path = tmp_path / "notes.bmp"
    path.write_text("BMW service history: oil changed in March, brakes in May.\n")
    with pytest.raises(SourceError, match="not a PDF, video or image"):
        detect_kind(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.pdf"
    path.write_bytes(b"")
    with pytest.raises(SourceError, match=r"empty file \(0 bytes\)"):
        detect_kind(path)


def test_html(tmp_path: Path) -> None:
    path = tmp_path / "invoice.pdf"
    path.write_text("<html><body><h1>Login required</h1></body></html>")
    with pytest.raises(SourceError, match="not a PDF, video or image") as info:
        detect_kind(path)
    assert "<html" in str(info.value)


def test_zip(tmp_path: Path) -> None:
    path = tmp_path / "documents.pdf"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("a.txt", "hello")
    with pytest.raises(SourceError, match="ZIP"):
        detect_kind(path)


@pytest.mark.parametrize("codec", ["aac", "mp2"])
def test_audio_only_media(tmp_path: Path, codec: str) -> None:
    path = _audio_only(tmp_path / "talk.mp4", codec)
    with pytest.raises(SourceError, match=r"no video stream \(audio only\)"):
        detect_kind(path)


def test_truncated_mp4_says_so(tmp_path: Path) -> None:
    # PyAV writes the index (moov) last, so a cut file cannot be opened at all.
    data = _video(tmp_path / "full.mp4").read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceError, match="truncated or corrupt"):
        detect_kind(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="not found"):
        detect_kind(tmp_path / "nope.pdf")


# -- detect + split over the bundled examples ----------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_bundled_examples_detect_and_split() -> None:
    from ingest.spec import IngestOptions
    from ingest.split import split_source
    from ingest.units import RenderedImage

    pdf = EXAMPLES / "invoice.pdf"
    clip = EXAMPLES / "clip.mp4"
    assert detect_kind(pdf) == "pdf"
    assert detect_kind(clip) == "video"

    pages = list(split_source(pdf, "pdf", IngestOptions(longest_side=640)))
    assert all(isinstance(p, RenderedImage) for p in pages)
    assert [p.image.size for p in pages] == [(453, 640), (640, 453), (453, 640)]  # page 2 has /Rotate 90
    assert "INV-2024-0042" in (pages[0].text or "")

    frames = list(split_source(clip, "video", IngestOptions(fps=1.0)))
    assert [f.timestamp for f in frames] == pytest.approx([0, 1, 2, 3, 4, 5], abs=1e-6)
    assert all(isinstance(f, RenderedImage) and f.image.size == (320, 240) for f in frames)
    assert [f.index for f in list(split_source(clip, "video", IngestOptions(num_frames=3)))] == [0, 1, 2]
