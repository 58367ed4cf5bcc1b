"""The one image writer (ingest.image_file): a standard PNG with exactly the image's pixels.

The cache key of a page or frame is the hash of its pixels, so what is written and read back
must hash the same; the filter chosen per band must not matter to that.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pymupdf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from ingest import image_file
from ingest.image_file import FILTER_NONE, FILTER_SUB, IMAGE_SUFFIX, encode_image, write_image
from ingest.pdf import render_pdf_pages
from ingest.stage import image_hash, image_key, store_image
from storage.object_store import open_object_store
from tests.media import write_pdf


def _read(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def _filter_bytes(data: bytes) -> set[int]:
    """The filter type of every row, from the PNG's (single) IDAT chunk."""
    width, height, _, color_type = struct.unpack(">IIBB", data[16:26])
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]
    start = data.index(b"IDAT") + 4
    length = struct.unpack(">I", data[start - 8 : start - 4])[0]
    raw = zlib.decompress(data[start : start + length])
    stride = width * channels + 1
    return {raw[row * stride] for row in range(height)}


def _page(tmp_path: Path) -> Image.Image:
    [unit] = list(render_pdf_pages(write_pdf(tmp_path / "p.pdf", pages=1)))
    return unit.image


def _photo_like(width: int = 320, height: int = 200) -> Image.Image:
    ys, xs = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(1)
    array = np.stack([xs * 0.7, ys * 1.1, (xs + ys) * 0.4], axis=-1) + rng.normal(0, 2, (height, width, 3))
    return Image.fromarray(np.clip(array, 0, 255).astype(np.uint8))


def test_a_rendered_page_keeps_its_pixels_and_its_cache_key(tmp_path: Path) -> None:
    page = _page(tmp_path)
    back = _read(encode_image(page))
    assert back.format == "PNG" and back.mode == "RGB" and back.size == page.size
    assert image_hash(back) == image_hash(page)


def _text_page(tmp_path: Path) -> Image.Image:
    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    words = " ".join(f"word{i % 97} total {i * 37 % 1000}.{i % 100:02d}" for i in range(900))
    page.insert_textbox(pymupdf.Rect(40, 40, 555, 800), words, fontsize=9)
    doc.save(str(tmp_path / "text.pdf"))
    [unit] = list(render_pdf_pages(tmp_path / "text.pdf"))
    return unit.image


def _one_filter_size(image: Image.Image, kind: int) -> int:
    rows = np.asarray(image).reshape(image.height, -1)
    return len(zlib.compress(image_file._filtered(rows, kind, len(image.mode)).tobytes(), 1))


def test_smooth_content_is_filtered_with_sub_and_flat_content_is_not() -> None:
    # Smooth content deflates best as differences, flat sharp-edged content as is (the docstring).
    assert _filter_bytes(encode_image(_photo_like())) == {FILTER_SUB}
    flat = np.full((64, 64, 3), 255, np.uint8)
    flat[10:20, 5:60] = (20, 40, 200)
    flat[::9, ::13] = 0
    assert _filter_bytes(encode_image(Image.fromarray(flat))) == {FILTER_NONE}


def test_the_choice_is_about_as_small_as_the_better_filter(tmp_path: Path) -> None:
    for image in (_page(tmp_path), _text_page(tmp_path), _photo_like()):
        best = min(_one_filter_size(image, FILTER_NONE), _one_filter_size(image, FILTER_SUB))
        assert len(encode_image(image)) < 1.25 * best  # ISA-L level 1 against zlib level 1


def test_smaller_than_raw_and_comparable_to_pillow(tmp_path: Path) -> None:
    page = _page(tmp_path)
    ours = len(encode_image(page))
    buffer = io.BytesIO()
    page.save(buffer, format="PNG", compress_level=1)
    assert ours < len(page.tobytes()) / 10
    assert ours < 2 * len(buffer.getvalue())


def test_a_tall_image_is_written_in_many_bands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_file, "BAND_BYTES", 4096)  # ~10 rows per band: many bands, both filters
    top = np.full((300, 128, 3), 255, np.uint8)
    top[::7, ::5] = 0  # sparse dots on white: a page
    bottom = np.asarray(_photo_like(128, 300))
    image = Image.fromarray(np.concatenate([top, bottom]))
    data = encode_image(image)
    assert _filter_bytes(data) == {FILTER_NONE, FILTER_SUB}
    assert _read(data).tobytes() == image.tobytes()


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "LA"])
@pytest.mark.parametrize("size", [(1, 1), (1, 57), (57, 1), (3, 2), (131, 77)])
def test_every_fast_mode_and_odd_sizes_round_trip(mode: str, size: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(size))
    channels = len(mode)
    array = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(array.squeeze(-1) if channels == 1 else array, mode=mode)
    back = _read(encode_image(image))
    assert (back.mode, back.size, back.tobytes()) == (mode, size, image.tobytes())


@pytest.mark.parametrize("mode", ["P", "1", "I;16", "CMYK"])
def test_other_modes_go_through_pillow_unchanged(mode: str) -> None:
    image = _photo_like(40, 30).convert(mode) if mode != "I;16" else Image.new("I;16", (40, 30), 1234)
    if mode == "CMYK":  # PNG has no CMYK: such an image is never a unit (units are RGB)
        with pytest.raises(OSError):
            encode_image(image)
        return
    back = _read(encode_image(image))
    assert back.tobytes() == image.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(1, 64),
    st.sampled_from(["noise", "flat", "stripes"]),
    st.integers(0, 2**32 - 1),
)
def test_any_rgb_image_round_trips_exactly(width: int, height: int, kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if kind == "noise":
        array = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    elif kind == "flat":
        array = np.full((height, width, 3), rng.integers(0, 256, 3), dtype=np.uint8)
    else:
        array = np.repeat(rng.integers(0, 256, (1, width, 3), dtype=np.uint8), height, axis=0)
    image = Image.fromarray(array)
    assert image_hash(_read(encode_image(image))) == image_hash(image)


def test_store_and_files_use_the_one_writer(tmp_path: Path) -> None:
    page = _page(tmp_path)
    store = open_object_store(f"file://{tmp_path / 'store'}")
    key = store_image(store, page)
    assert key == image_key(image_hash(page)) and key.endswith(IMAGE_SUFFIX)
    assert store.get_bytes(key) == encode_image(page)
    assert image_hash(_read(store.get_bytes(key))) == image_hash(page)
    file = tmp_path / f"page{IMAGE_SUFFIX}"
    assert write_image(page, file) == file.stat().st_size
    assert file.read_bytes() == encode_image(page)


def test_the_encode_stage_reads_the_hash_back_from_the_key(tmp_path: Path) -> None:
    from worker.tokens.store import image_hash_of

    page = _page(tmp_path)
    assert image_hash_of(image_key(image_hash(page))) == image_hash(page)


def test_pymupdf_reads_it_too(tmp_path: Path) -> None:
    """Any PNG reader, not only PIL: a person's viewer, or MuPDF."""
    page = _page(tmp_path)
    pix = pymupdf.Pixmap(encode_image(page))
    assert (pix.width, pix.height) == page.size
    assert pix.samples == page.tobytes()
