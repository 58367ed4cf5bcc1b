"""load_image / normalize_rgb: upright, 8-bit RGB, alpha on white, errors as SourceError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ingest.images import load_image, normalize_rgb
from ingest.units import SourceError

RED = (255, 0, 0)
WHITE = (255, 255, 255)


def _close(actual: tuple[int, ...], expected: tuple[int, ...], tol: int = 12) -> bool:
    return all(abs(a - e) <= tol for a, e in zip(actual, expected, strict=True))


def test_exif_orientation_6_is_applied(tmp_path: Path) -> None:
    # Stored 40x20 with a red block at the top-left; Orientation 6 = "turn 90 degrees
    # clockwise to display", which puts that block at the top-right of a 20x40 picture.
    stored = Image.new("RGB", (40, 20), (0, 0, 255))
    stored.paste(RED, (0, 0, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "phone.jpg"
    stored.save(path, "JPEG", quality=95, exif=exif.tobytes())

    unit = load_image(path)

    assert unit.index == 0
    assert unit.image.mode == "RGB"
    assert unit.image.size == (20, 40)
    assert _close(unit.image.getpixel((15, 4)), RED, tol=40)
    assert _close(unit.image.getpixel((4, 35)), (0, 0, 255), tol=40)


@pytest.mark.parametrize("fmt", ["JPEG", "TIFF"])
def test_cmyk(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"print.{fmt.lower()}"
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(path, fmt)
    image = load_image(path).image
    assert image.mode == "RGB"
    assert _close(image.getpixel((8, 8)), RED, tol=30)


def test_16bit_grey_png_is_scaled_not_clipped(tmp_path: Path) -> None:
    data = np.array([[0, 32768, 65535, 1000]], dtype=np.uint16)
    path = tmp_path / "scan16.png"
    Image.fromarray(data).save(path)
    assert Image.open(path).mode.startswith("I")  # really a 16-bit file
    image = load_image(path).image
    assert image.mode == "RGB"
    values = [image.getpixel((x, 0))[0] for x in range(4)]
    assert values[0] == 0
    assert 126 <= values[1] <= 129
    assert values[2] == 255
    assert values[3] <= 4  # Pillow's own conversion would clip 1000 to 255 (white)


def test_palette_with_transparency_goes_on_white(tmp_path: Path) -> None:
    pal = Image.new("P", (10, 10), 1)
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * (254 * 3))
    pal.paste(0, (0, 0, 5, 10))  # left half: index 0, transparent (and black in the palette)
    path = tmp_path / "logo.png"
    pal.save(path, transparency=0)
    image = load_image(path).image
    assert image.mode == "RGB"
    assert image.getpixel((2, 5)) == WHITE
    assert image.getpixel((7, 5)) == RED


def test_rgba_is_composited_on_white(tmp_path: Path) -> None:
    rgba = Image.new("RGBA", (10, 10), (255, 0, 0, 0))
    rgba.paste((255, 0, 0, 255), (0, 0, 5, 10))
    rgba.paste((0, 0, 0, 128), (5, 0, 10, 5))
    path = tmp_path / "sticker.png"
    rgba.save(path)
    image = load_image(path).image
    assert image.mode == "RGB"
    assert image.getpixel((2, 2)) == RED
    assert _close(image.getpixel((7, 2)), (127, 127, 127), tol=2)
    assert image.getpixel((7, 8)) == WHITE


@pytest.mark.parametrize(
    ("mode", "fill", "expected"),
    [("LA", (0, 0), WHITE), ("LA", (0, 255), (0, 0, 0)), ("1", 1, WHITE), ("L", 100, (100, 100, 100))],
)
def test_other_modes(mode: str, fill: int | tuple[int, ...], expected: tuple[int, int, int]) -> None:
    image = normalize_rgb(Image.new(mode, (4, 4), fill))
    assert image.mode == "RGB"
    assert image.getpixel((1, 1)) == expected


def test_32bit_int_and_float_modes() -> None:
    deep = normalize_rgb(Image.fromarray(np.array([[0, 65535]], dtype=np.int32)))
    assert [deep.getpixel((x, 0))[0] for x in range(2)] == [0, 255]
    narrow = normalize_rgb(Image.fromarray(np.array([[0, 200]], dtype=np.int32)))
    assert [narrow.getpixel((x, 0))[0] for x in range(2)] == [0, 200]
    unit = normalize_rgb(Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)))
    assert [unit.getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]


def test_rgb_passes_through_and_outlives_the_file(tmp_path: Path) -> None:
    path = tmp_path / "plain.png"
    Image.new("RGB", (5, 3), (1, 2, 3)).save(path)
    image = load_image(path).image
    assert image.size == (5, 3)
    assert image.getpixel((0, 0)) == (1, 2, 3)  # still usable after the file was closed


def test_animated_gif_gives_first_frame(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (8, 8), RED), Image.new("RGB", (8, 8), (0, 0, 255))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100)
    image = load_image(path).image
    assert _close(image.getpixel((4, 4)), RED, tol=10)


def test_truncated_image_is_a_source_error(tmp_path: Path) -> None:
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    full = tmp_path / "full.png"
    noisy.save(full)
    path = tmp_path / "cut.png"
    path.write_bytes(full.read_bytes()[:2000])
    with pytest.raises(SourceError, match="cannot decode image"):
        load_image(path)


def test_garbage_is_a_source_error(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 50)
    with pytest.raises(SourceError):
        load_image(path)


def test_pixel_guard(tmp_path: Path) -> None:
    path = tmp_path / "big.png"
    Image.new("RGB", (30, 30)).save(path)
    with pytest.raises(SourceError, match="too large"):
        load_image(path, max_pixels=500)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_is_refused_before_decoding(tmp_path: Path) -> None:
    # A 1-bit PNG claiming 20000 x 20000 pixels: ~50 KB on disk, 1.2 GB as RGB.
    path = tmp_path / "bomb.png"
    Image.new("1", (20_000, 20_000)).save(path, optimize=True)
    with pytest.raises(SourceError, match="too large"):
        load_image(path)


def test_rgb_colour_key_transparency_goes_on_white(tmp_path: Path) -> None:
    keyed = Image.new("RGB", (4, 4), (0, 255, 0))
    keyed.paste(RED, (0, 0, 2, 4))
    path = tmp_path / "keyed.png"
    keyed.save(path, transparency=(0, 255, 0))
    image = load_image(path).image
    assert image.getpixel((0, 0)) == RED
    assert image.getpixel((3, 3)) == WHITE
