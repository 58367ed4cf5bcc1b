"""Q1b. Lossless image files: time against size, for the one writer of unit images.

Every page and frame is written once as a lossless file (the store's object, or an export's
file), so the encoder is on ingest's hot path. On real-looking inputs, in this process:
12 report pages rendered at 1288 px (bench/media.py) and 8 frames of the 720p test video, each
encoder's time per image (median of the repetitions) and size, every file read back and
compared pixel for pixel:
  * visbatch's writer (ingest/image_file.py: PNG, None or Sub filter per band, ISA-L deflate);
  * Pillow's PNG at compress_level 0, 1 (the old path) and 6 (its default);
  * MuPDF's own PNG (pages only: it writes pixmaps);
  * WebP lossless at its fastest (method 0, quality 0) and TIFF with deflate: other lossless
    formats PIL and the model's processor read (TIFF is not shown by browsers).
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable

from PIL import Image

from bench.common import Check, arguments, bars, rounded, write_result
from bench.media import report_pdf, video
from ingest.image_file import encode_image
from ingest.mupdf import pymupdf

LONGEST_SIDE = 1288


def pages(count: int) -> list[Image.Image]:
    doc = pymupdf.open(str(report_pdf(count, variant="png")))
    out = []
    for page in doc:
        zoom = LONGEST_SIDE / max(page.rect.width, page.rect.height)
        pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), colorspace=pymupdf.csRGB, alpha=False)
        out.append(Image.frombytes("RGB", (pix.width, pix.height), pix.samples))
    return out


def frames(count: int, quick: bool) -> list[Image.Image]:
    import av

    path = video(20, (640, 360), gop_seconds=8.0) if quick else video(120, (1280, 720), gop_seconds=8.0)
    out = []
    with av.open(str(path)) as container:
        for n, frame in enumerate(container.decode(video=0)):
            if n % 50 == 0:
                out.append(frame.to_image())
            if len(out) == count:
                break
    return out


def pillow(**options) -> Callable[[Image.Image], bytes]:
    def encode(image: Image.Image) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, **options)
        return buffer.getvalue()

    return encode


def mupdf_png(image: Image.Image) -> bytes:
    pix = pymupdf.Pixmap(pymupdf.csRGB, image.width, image.height, image.tobytes(), False)
    return pix.tobytes("png")


ENCODERS: dict[str, Callable[[Image.Image], bytes]] = {
    "visbatch PNG": encode_image,
    "Pillow PNG level 0": pillow(format="PNG", compress_level=0),
    "Pillow PNG level 1": pillow(format="PNG", compress_level=1),
    "Pillow PNG level 6": pillow(format="PNG", compress_level=6),
    "MuPDF PNG": mupdf_png,
    "WebP lossless m0": pillow(format="WEBP", lossless=True, method=0, quality=0),
    "TIFF deflate": pillow(format="TIFF", compression="tiff_adobe_deflate"),
}


def measure(images: list[Image.Image], reps: int) -> dict[str, dict[str, float]]:
    result = {}
    for name, encode in ENCODERS.items():
        seconds, sizes = [], []
        for _ in range(reps):
            started = time.perf_counter()
            encoded = [encode(image) for image in images]
            seconds.append((time.perf_counter() - started) / len(images))
            sizes = [len(data) for data in encoded]
        for image, data in zip(images, encoded, strict=True):
            back = Image.open(io.BytesIO(data)).convert("RGB")
            if back.tobytes() != image.tobytes():
                raise RuntimeError(f"{name} is not lossless")
        result[name] = {
            "ms_per_image": rounded(statistics.median(seconds) * 1000),
            "kib_per_image": rounded(statistics.mean(sizes) / 1024),
        }
    return result


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=2)
    inputs = {"pages": pages(4 if args.quick else 12), "frames": frames(3 if args.quick else 8, args.quick)}
    figures: dict = {
        kind: f"{len(images)} {kind}, {images[0].size[0]}x{images[0].size[1]}"
        for kind, images in inputs.items()
    }
    checks = []
    chart_labels, chart_values = [], []
    for kind, images in inputs.items():
        result = measure(images, args.reps)
        figures[kind + "_results"] = result
        ours, old = result["visbatch PNG"], result["Pillow PNG level 1"]
        speed = rounded(old["ms_per_image"] / ours["ms_per_image"])
        size = rounded(ours["kib_per_image"] / old["kib_per_image"])
        checks.append(
            Check(f"{kind}: visbatch PNG speed vs Pillow PNG level 1 (the old path)", speed, ">=", 3.0)
        )
        checks.append(Check(f"{kind}: visbatch PNG size vs Pillow PNG level 1", size, "<=", 1.3))
        for name in ("visbatch PNG", "Pillow PNG level 1", "WebP lossless m0"):
            chart_labels.append(f"{kind}: {name}")
            chart_values.append(result[name]["ms_per_image"])
    write_result(
        "image_encoding",
        quick=args.quick,
        question="Lossless image files: encode time and size",
        baseline="Pillow PNG compress_level=1 (the old writer), same images, same process",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(chart_labels, chart_values, "ms per image (lower is better)", "Q1b image encoding"),
    )


if __name__ == "__main__":
    main()
