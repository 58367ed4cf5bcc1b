"""The one way unit images are written: lossless PNG, encoded fast.

Every page and frame is written once (to the store, or to `visbatch ingest --out`), so the
encoder sits on the hot path of ingest. Pillow's PNG encoder picks one of five filters per row
by trying them all, which costs more than rendering the page (~25 ms for a 1288-px page, ~100
ms for a 720p photo-like frame, at any compress level). Here each band of rows is filtered
with "None" or "Sub", whichever deflates smaller on a sample of its rows, and deflated by ISA-L
at level 1 (``isal``): 5-10x faster, about 15% larger than Pillow at level 1 on pages and as
small on photos (bench/image_encoding.py measures it). The file is a plain 8-bit PNG that every
viewer, PIL and the model's processor read; the pixels are exactly the image's (the cache key
is the hash of the pixels, see ingest.stage.image_hash).
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from isal import isal_zlib
from PIL import Image

IMAGE_SUFFIX = ".png"
DEFLATE_LEVEL = 1  # ISA-L levels are 0-3; 1 is as fast as 0 here and 15% smaller
# Rows are filtered and deflated in bands of about this many bytes: memory stays bounded on a
# 50-megapixel page, and per-call overhead stays negligible on a small frame.
BAND_BYTES = 1 << 20
SAMPLE_EVERY = 8  # the filter of a band is chosen on every 8th run of SAMPLE_RUN rows
SAMPLE_RUN = 4
FILTER_NONE, FILTER_SUB = 0, 1
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPES = {"L": 0, "RGB": 2, "LA": 4, "RGBA": 6}  # 8 bits per channel


def encode_image(image: Image.Image) -> bytes:
    """The image as PNG bytes (8-bit L, LA, RGB, RGBA by the fast path; other modes by Pillow)."""
    color_type = _COLOR_TYPES.get(image.mode)
    if color_type is None:  # 1-bit, palette, 16-bit ...: rare here (units are RGB); keep them exact
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=DEFLATE_LEVEL)
        return buffer.getvalue()
    width, height = image.size
    channels = len(image.mode)
    row_bytes = width * channels
    rows_per_band = max(1, BAND_BYTES // max(row_bytes, 1))
    compressor = isal_zlib.compressobj(DEFLATE_LEVEL)
    parts = []
    for top in range(0, height, rows_per_band):
        bottom = min(height, top + rows_per_band)
        band = np.frombuffer(image.crop((0, top, width, bottom)).tobytes(), np.uint8)
        band = band.reshape(bottom - top, row_bytes)
        parts.append(compressor.compress(_filtered(band, _choose_filter(band, channels), channels)))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return b"".join(
        (_PNG_SIGNATURE, _chunk(b"IHDR", header), _chunk(b"IDAT", b"".join(parts)), _chunk(b"IEND", b""))
    )


def write_image(image: Image.Image, path: Path) -> int:
    """Write the image to ``path`` (which should end in IMAGE_SUFFIX); returns the bytes written."""
    data = encode_image(image)
    path.write_bytes(data)
    return len(data)


def _filtered(band: np.ndarray, filter_type: int, channels: int) -> np.ndarray:
    """The rows, each after its PNG filter byte (None: as is; Sub: minus the pixel to the left)."""
    rows, row_bytes = band.shape
    out = np.empty((rows, row_bytes + 1), np.uint8)
    out[:, 0] = filter_type
    if filter_type == FILTER_NONE:
        out[:, 1:] = band
    else:
        out[:, 1 : 1 + channels] = band[:, :channels]
        np.subtract(band[:, channels:], band[:, :-channels], out=out[:, 1 + channels :])  # wraps mod 256
    return out


def _choose_filter(band: np.ndarray, channels: int) -> int:
    """None or Sub, whichever deflates smaller on a sample of the band's rows.

    Flat, sharp-edged content (pages: white paper, text, rules) deflates best unfiltered, since
    glyphs repeat byte for byte; smooth content (photos, video) best as differences (Sub). The
    sample is runs of adjacent rows, so that matches between neighbouring rows still count.
    """
    rows = band.shape[0]
    if rows <= SAMPLE_RUN * 2:
        sample = band
    else:
        starts = np.arange(0, rows - SAMPLE_RUN + 1, SAMPLE_RUN * SAMPLE_EVERY)
        sample = band[(starts[:, None] + np.arange(SAMPLE_RUN)[None, :]).ravel()]
    sizes = [
        len(isal_zlib.compress(_filtered(sample, kind, channels), DEFLATE_LEVEL))
        for kind in (FILTER_NONE, FILTER_SUB)
    ]
    return FILTER_NONE if sizes[0] <= sizes[1] else FILTER_SUB


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
