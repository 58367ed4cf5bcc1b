"""Generate the bundled demo inputs: examples/invoice.pdf and examples/clip.mp4.

    python examples/make_examples.py [OUT_DIR]      (default: the examples/ folder)

Everything is drawn from code, so the files carry no third-party content (see LICENSE.md),
and the output is the same on every run (fixed metadata, single-threaded encoder).
"""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pymupdf
from PIL import Image, ImageDraw, ImageFont

A4 = (595, 842)  # points
FIXED_DATE = "D:20240315120000Z"

ITEMS = [
    ("Widget, stainless, 40 mm", 12, 3.50),
    ("Gasket set (10 pcs)", 4, 7.25),
    ("Hex bolts M8 x 30 (box of 100)", 2, 18.90),
    ("Assembly labour (hours)", 3, 45.00),
    ("Delivery", 1, 12.00),
]
TAX_RATE = 0.20

VIDEO_SIZE = (320, 240)
VIDEO_FPS = 15
VIDEO_SECONDS = 6


def make_invoice(path: Path) -> None:
    doc = pymupdf.open()
    _invoice_page(doc.new_page(width=A4[0], height=A4[1]))
    _terms_page(doc.new_page(width=A4[0], height=A4[1]))
    _chart_page(doc.new_page(width=A4[0], height=A4[1]))
    doc.set_metadata(
        {
            "title": "Invoice INV-2024-0042",
            "author": "visbatch examples",
            "creator": "examples/make_examples.py",
            "producer": "PyMuPDF",
            "creationDate": FIXED_DATE,
            "modDate": FIXED_DATE,
        }
    )
    # no_new_id: MuPDF would otherwise write a fresh random /ID and the file would differ per run.
    doc.save(path, garbage=4, deflate=True, no_new_id=True)
    doc.close()


def _invoice_page(page: pymupdf.Page) -> None:
    page.insert_text((50, 70), "INVOICE", fontsize=28, fontname="hebo")
    page.insert_text((50, 95), "Acme Fasteners Ltd, 12 Harbour Road, Portsmouth PO1 3AX", fontsize=9)
    right = [("Invoice no.", "INV-2024-0042"), ("Date", "2024-03-15"), ("Due", "2024-04-14")]
    for row, (label, value) in enumerate(right):
        y = 60 + row * 16
        page.insert_text((380, y), label, fontsize=10, fontname="hebo")
        page.insert_text((460, y), value, fontsize=10)
    page.insert_text((50, 140), "Bill to:", fontsize=10, fontname="hebo")
    for row, line in enumerate(["Northwind Traders", "Attn: Accounts Payable", "88 Market Street, Leeds"]):
        page.insert_text((50, 156 + row * 14), line, fontsize=10)

    columns = [50, 330, 390, 470, 545]
    headers = ["Description", "Qty", "Unit price", "Amount"]
    top = 230
    page.draw_rect(pymupdf.Rect(columns[0], top, columns[-1], top + 20), color=None, fill=(0.85, 0.88, 0.95))
    for col, header in enumerate(headers):
        page.insert_text((columns[col] + 4, top + 14), header, fontsize=10, fontname="hebo")
    subtotal = 0.0
    y = top + 20
    for description, qty, price in ITEMS:
        amount = qty * price
        subtotal += amount
        cells = [description, str(qty), f"{price:.2f}", f"{amount:.2f}"]
        for col, cell in enumerate(cells):
            page.insert_text((columns[col] + 4, y + 14), cell, fontsize=10)
        y += 20
        page.draw_line((columns[0], y), (columns[-1], y), color=(0.6, 0.6, 0.6), width=0.5)
    for x in columns:
        page.draw_line((x, top), (x, y), color=(0.3, 0.3, 0.3), width=0.5)
    page.draw_rect(pymupdf.Rect(columns[0], top, columns[-1], y), color=(0, 0, 0), width=1)

    tax = round(subtotal * TAX_RATE, 2)
    totals = [("Subtotal", subtotal), (f"VAT {TAX_RATE:.0%}", tax), ("Total due (GBP)", subtotal + tax)]
    for row, (label, value) in enumerate(totals):
        ty = y + 24 + row * 18
        font = "hebo" if row == len(totals) - 1 else "helv"
        page.insert_text((360, ty), label, fontsize=11, fontname=font)
        page.insert_text((474, ty), f"{value:.2f}", fontsize=11, fontname=font)
    page.insert_text((50, 780), "Payment by bank transfer. Sort code 12-34-56, account 87654321.", fontsize=9)


def _terms_page(page: pymupdf.Page) -> None:
    # Written upright, then /Rotate 90: viewers (and our renderer) must show it landscape.
    page.insert_text((50, 70), "Terms and conditions", fontsize=20, fontname="hebo")
    terms = [
        "1. Payment is due within 30 days of the invoice date.",
        "2. Late payments incur interest at 4% above base rate.",
        "3. Goods remain our property until paid in full.",
        "4. Report damaged deliveries within 7 days.",
    ]
    for row, line in enumerate(terms):
        page.insert_text((50, 110 + row * 18), line, fontsize=11)
    page.set_rotation(90)


def _chart_page(page: pymupdf.Page) -> None:
    page.insert_text((50, 70), "Quarterly revenue 2023 (kGBP)", fontsize=18, fontname="hebo")
    values = [("Q1", 120), ("Q2", 185), ("Q3", 150), ("Q4", 230)]
    colours = [(0.27, 0.51, 0.71), (0.87, 0.49, 0.2), (0.35, 0.63, 0.35), (0.8, 0.3, 0.3)]
    base_y, left = 500, 90
    page.draw_line((left - 10, base_y), (left + 420, base_y), color=(0, 0, 0), width=1)
    page.draw_line((left - 10, base_y), (left - 10, base_y - 320), color=(0, 0, 0), width=1)
    for i, ((label, value), colour) in enumerate(zip(values, colours, strict=True)):
        x = left + i * 105
        page.draw_rect(pymupdf.Rect(x, base_y - value * 1.3, x + 70, base_y), color=None, fill=colour)
        page.insert_text((x + 25, base_y + 18), label, fontsize=11)
        page.insert_text((x + 20, base_y - value * 1.3 - 6), str(value), fontsize=10)
    page.draw_circle((300, 660), 60, color=(0.2, 0.2, 0.2), fill=(0.95, 0.85, 0.3), width=1)
    page.draw_oval(pymupdf.Rect(400, 620, 520, 700), color=(0.2, 0.2, 0.2), fill=(0.6, 0.8, 0.95))
    page.insert_text((250, 760), "Shapes: a circle and an oval", fontsize=10)


def make_clip(path: Path) -> None:
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=VIDEO_FPS)
        stream.width, stream.height = VIDEO_SIZE
        stream.pix_fmt = "yuv420p"
        # One thread and fixed options: x264's output depends on its thread count.
        stream.codec_context.thread_count = 1
        if codec == "libx264":
            stream.options = {"crf": "30", "preset": "medium", "g": str(VIDEO_FPS), "threads": "1"}
        else:
            stream.bit_rate = 200_000
            stream.codec_context.gop_size = VIDEO_FPS
        stream.codec_context.time_base = Fraction(1, VIDEO_FPS)
        # All frames are made (and kept alive) before encoding: frames converted and freed
        # inside the loop gave different bytes from run to run with libx264.
        frames = _clip_frames()
        for frame in frames:
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def _clip_frames() -> list[av.VideoFrame]:
    font = _font(28)
    frames = []
    for index in range(VIDEO_FPS * VIDEO_SECONDS):
        rgb = av.VideoFrame.from_ndarray(np.asarray(_clip_frame(index, font)), format="rgb24")
        frame = rgb.reformat(format="yuv420p")
        frame.pts = index
        frames.append(frame)
    return frames


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow's bundled font: same on every machine
    except TypeError:  # Pillow without FreeType
        return ImageFont.load_default()


def _clip_frame(index: int, font: ImageFont.ImageFont | ImageFont.FreeTypeFont) -> Image.Image:
    width, height = VIDEO_SIZE
    t = index / VIDEO_FPS
    image = Image.new("RGB", VIDEO_SIZE, (20, 24, 40))
    draw = ImageDraw.Draw(image)
    # A red ball bounces left-right, a green square sweeps down, a blue bar grows with time.
    span = width - 60
    phase = (index * 4) % (2 * span)
    ball_x = 30 + (phase if phase < span else 2 * span - phase)
    draw.ellipse((ball_x - 22, 60, ball_x + 22, 104), fill=(220, 60, 60))
    square_y = 20 + (index * 3) % (height - 90)
    draw.rectangle((250, square_y, 290, square_y + 40), fill=(60, 200, 90))
    bar = int((width - 40) * (index + 1) / (VIDEO_FPS * VIDEO_SECONDS))
    draw.rectangle((20, height - 30, 20 + bar, height - 16), fill=(70, 130, 230))
    draw.text((16, 12), f"frame {index:03d}  t={t:4.1f}s", fill=(255, 255, 255), font=font)
    return image


def main(argv: list[str]) -> None:
    out_dir = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    make_invoice(out_dir / "invoice.pdf")
    make_clip(out_dir / "clip.mp4")
    for name in ("invoice.pdf", "clip.mp4"):
        print(f"{out_dir / name}: {(out_dir / name).stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv)
