"""Load a still image as an upright 8-bit RGB picture."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageCms, ImageOps

from ingest.units import RenderedImage, SourceError

# 200 megapixels is already ~600 MB as RGB; anything bigger is a scan gone wrong or a
# decompression bomb (a tiny PNG that claims 100k x 100k pixels), and must not take the
# worker down. Pillow only *warns* between MAX_IMAGE_PIXELS and twice that (and raises
# beyond), so we also check the header size ourselves before decoding.
MAX_IMAGE_PIXELS = 200_000_000
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

WHITE = (255, 255, 255)
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_16BIT_MODES = {"I;16", "I;16L", "I;16B", "I;16N"}


def load_image(path: Path, *, max_pixels: int = MAX_IMAGE_PIXELS) -> RenderedImage:
    """Decode the image at ``path``: EXIF orientation applied, RGB, alpha flattened on white.

    Multi-frame files (animated GIF, multi-page TIFF) give their first frame only.
    Any decode failure is a SourceError.
    """
    try:
        with Image.open(path) as img:
            _check_size(img.size, max_pixels)  # from the header, before a single pixel is decoded
            img.load()
            upright = _exif_upright(img)
            rgb = normalize_rgb(upright)
            if rgb is img:
                # Leaving the with-block closes `img`; hand out an image that outlives it.
                rgb = img.copy()
    except SourceError:
        raise
    except Image.DecompressionBombError as exc:
        raise SourceError(f"image is too large (over {MAX_IMAGE_PIXELS // 1_000_000} megapixels)") from exc
    except FileNotFoundError as exc:
        raise SourceError("file not found") from exc
    except Image.UnidentifiedImageError as exc:
        raise SourceError("not a readable image (unknown or corrupt format)") from exc
    except (OSError, ValueError, SyntaxError, MemoryError, EOFError) as exc:
        # Pillow reports truncated/corrupt data as OSError, bad headers as SyntaxError/ValueError.
        raise SourceError(f"cannot decode image: {exc}") from exc
    return RenderedImage(index=0, image=rgb)


def _check_size(size: tuple[int, int], max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise SourceError(f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise SourceError(f"image is too large ({width}x{height}, over {max_pixels / 1e6:g} megapixels)")


def _exif_upright(img: Image.Image) -> Image.Image:
    # A malformed EXIF block must not cost the whole image: keep it as stored.
    try:
        return ImageOps.exif_transpose(img) or img
    except Exception:
        return img


def normalize_rgb(img: Image.Image) -> Image.Image:
    """Return ``img`` as 8-bit RGB: alpha composited on white, 16-bit scaled, CMYK converted."""
    mode = img.mode
    if mode in ("P", "L", "1", "RGB") and "transparency" in img.info:
        # Palette and colour-key transparency (PNG tRNS) live in img.info; RGBA makes it alpha.
        return _flatten_alpha(img.convert("RGBA"))
    if mode == "RGB":
        return img
    if mode in _ALPHA_MODES:
        return _flatten_alpha(img.convert("RGBA"))
    if mode == "CMYK":
        return _cmyk_to_rgb(img)
    if mode in _16BIT_MODES or mode == "I":
        return _deep_grey_to_rgb(img)
    if mode == "F":
        return _float_grey_to_rgb(img)
    # "1", "L", "YCbCr", "LAB", "HSV", "RGBX" ...: Pillow's own conversion is right for these.
    return img.convert("RGB")


def _flatten_alpha(rgba: Image.Image) -> Image.Image:
    # Transparent areas of documents/logos are meant to be paper: white, not black.
    background = Image.new("RGBA", rgba.size, WHITE + (255,))
    background.alpha_composite(rgba)
    return background.convert("RGB")


def _cmyk_to_rgb(img: Image.Image) -> Image.Image:
    # Pillow's naive CMYK->RGB formula gives washed-out colours; an embedded print
    # profile (common in CMYK JPEGs from prepress) converts properly to sRGB.
    icc = img.info.get("icc_profile")
    if icc:
        try:
            src = ImageCms.ImageCmsProfile(io.BytesIO(icc))
            dst = ImageCms.createProfile("sRGB")
            converted = ImageCms.profileToProfile(img, src, dst, outputMode="RGB")
            if converted is not None:
                return converted
        except Exception:  # a broken profile falls back to the formula
            pass
    return img.convert("RGB")


def _deep_grey_to_rgb(img: Image.Image) -> Image.Image:
    # Pillow's convert("L") clips 16-bit values at 255 (nearly everything goes white);
    # scale the 0..65535 range down instead. Mode "I" (32-bit) usually carries 16-bit
    # samples too; if all values fit in a byte it is 8-bit data in a wide container.
    data = np.asarray(img).astype(np.int64)  # astype also undoes a big-endian I;16B layout
    if img.mode == "I" and data.size and int(data.max()) <= 255:
        grey = np.clip(data, 0, 255)
    else:
        grey = np.clip(data, 0, 65535) // 257
    return Image.fromarray(grey.astype(np.uint8)).convert("RGB")


def _float_grey_to_rgb(img: Image.Image) -> Image.Image:
    data = np.asarray(img, dtype=np.float64)
    data = np.nan_to_num(data, nan=0.0, posinf=0.0, neginf=0.0)
    # Float images are either 0..1 (scientific) or 0..255 (Pillow's own float mode).
    if data.size and float(data.max()) <= 1.0:
        data = data * 255.0
    return Image.fromarray(np.clip(np.rint(data), 0, 255).astype(np.uint8)).convert("RGB")
