"""Q1. PDF pages to PNG images: `visbatch ingest` against `pdftoppm -png -scale-to 1288`.

Both sides use both cores the same way: two processes in parallel, each over half the page
range, each writing one PNG per page at a longest side of 1288 px; process start included
(a user runs either as a command). A bare PyMuPDF render-and-PNG loop (same PNG settings as
visbatch, compress_level=1) runs beside them as the floor: what rendering and encoding cost
without anything visbatch adds (pixel hash, text layer, token count, manifest, start-up).

In full mode each arm also runs over 2 pages per process, which splits its time into a fixed
start-up cost and a per-page cost.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import (
    Check,
    arguments,
    bars,
    interleaved,
    median,
    paired_ratio,
    rounded,
    tool,
    write_result,
)
from bench.media import report_pdf
from bench.models import bench_model

LONGEST_SIDE = 1288
VISBATCH = str(Path(sys.executable).with_name("visbatch"))

BARE_LOOP = f"""
import sys, pymupdf
from PIL import Image
path, first, last, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
doc = pymupdf.open(path)
for i in range(first - 1, last):
    page = doc.load_page(i)
    zoom = {LONGEST_SIDE} / max(page.rect.width, page.rect.height)
    pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), colorspace=pymupdf.csRGB, alpha=False)
    image = Image.frombytes("RGB", (pix.width, pix.height), pix.samples, "raw", "RGB", pix.stride)
    image.save(f"{{out}}/p-{{i + 1:05d}}.png", format="PNG", compress_level=1)
"""


def halves(pages: int) -> list[tuple[int, int]]:
    mid = pages // 2
    return [(1, mid), (mid + 1, pages)]


def command(arm: str, pdf: Path, first: int, last: int, out: Path, model: Path) -> list[str]:
    if arm == "pdftoppm":
        return [
            "pdftoppm",
            "-png",
            "-scale-to",
            str(LONGEST_SIDE),
            "-f",
            str(first),
            "-l",
            str(last),
            str(pdf),
            str(out / "p"),
        ]
    if arm == "visbatch":
        return [
            VISBATCH,
            "ingest",
            str(pdf),
            "--pages",
            f"{first}-{last}",
            "--out",
            str(out),
            "--longest-side",
            str(LONGEST_SIDE),
            "--model",
            str(model),
        ]
    return [sys.executable, "-c", BARE_LOOP, str(pdf), str(first), str(last), str(out)]


def run_parallel(arm: str, pdf: Path, ranges: list[tuple[int, int]], work: Path, model: Path) -> int:
    """Run one process per page range at once; returns the PNGs written."""
    outs = []
    procs = []
    env = {**os.environ, "VISBATCH_HOME": str(work / "home")}
    for n, (first, last) in enumerate(ranges):
        out = Path(tempfile.mkdtemp(prefix=f"{arm}-{n}-", dir=work))
        outs.append(out)
        argv = command(arm, pdf, first, last, out, model)
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{arm} exited {proc.returncode}: {err.decode(errors='replace')[-1500:]}")
    written = sum(len(list(out.rglob("*.png"))) for out in outs)
    for out in outs:
        subprocess.run(["rm", "-rf", str(out)], check=True)
    return written


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=2)
    pages = 40 if args.quick else 200
    pdf = report_pdf(pages)
    model = bench_model("tiny")
    arms = ["visbatch", "bare PyMuPDF loop"]
    notes = []
    if tool("pdftoppm"):
        arms.insert(0, "pdftoppm")
    else:
        notes.append("pdftoppm is not installed (apt-get install poppler-utils): its baseline was skipped")
    with tempfile.TemporaryDirectory(prefix="bench-pdf-") as tmp:
        work = Path(tmp)
        ranges = halves(pages)

        def arm_fn(arm: str, page_ranges: list[tuple[int, int]], expected: int):
            def go(_rep: int) -> None:
                written = run_parallel(arm, pdf, page_ranges, work, model)
                if written != expected:
                    raise RuntimeError(f"{arm} wrote {written} PNGs, expected {expected}")

            return go

        seconds = interleaved({a: arm_fn(a, ranges, pages) for a in arms}, args.reps)
        start_seconds = {}
        if not args.quick:
            two = [(first, first + 1) for first, _ in ranges]
            start_seconds = interleaved({a: arm_fn(a, two, 4) for a in arms}, args.reps)

    rate = {a: pages / median(s) for a, s in seconds.items()}
    figures: dict = {
        "pages": pages,
        "longest_side": LONGEST_SIDE,
        "processes_per_arm": 2,
        "timings": seconds.rounded(),
        "pages_per_s": {a: rounded(r) for a, r in rate.items()},
    }
    checks = []
    if "pdftoppm" in seconds:
        ours = paired_ratio(seconds["pdftoppm"], seconds["visbatch"])
        bare = paired_ratio(seconds["pdftoppm"], seconds["bare PyMuPDF loop"])
        figures["speedup_vs_pdftoppm"] = {"visbatch": rounded(ours), "bare PyMuPDF loop": rounded(bare)}
        checks.append(
            Check(
                f"visbatch ingest pages/s vs pdftoppm ({pages} pages, 2 processes each)",
                rounded(ours),
                ">=",
                6.0,
            )
        )
    else:
        checks.append(Check("visbatch ingest pages/s vs pdftoppm", None, ">=", 6.0, note="pdftoppm missing"))
    if start_seconds:
        figures["start_seconds_2_pages_per_process"] = {
            a: [round(x, 3) for x in s] for a, s in start_seconds.items()
        }
        split = {}
        for a in seconds:
            fixed = median(start_seconds[a])
            per_page = max(median(seconds[a]) - fixed, 1e-9) / (pages - 4)
            split[a] = {"fixed_s": rounded(fixed), "per_page_ms_both_cores": rounded(per_page * 1000)}
        figures["fixed_and_per_page"] = split
        if "pdftoppm" in split:
            steady = split["pdftoppm"]["per_page_ms_both_cores"] / split["visbatch"]["per_page_ms_both_cores"]
            figures["per_page_speedup_without_start"] = rounded(steady)
            notes.append(
                f"without process start, visbatch's per-page cost is {steady:.1f}x lower than pdftoppm's; "
                f"its fixed cost (two processes at once, 2 pages each) is "
                f"{split['visbatch']['fixed_s']:.1f} s (pdftoppm {split['pdftoppm']['fixed_s']:.2f} s)"
            )
    labels = list(rate)
    write_result(
        "pdf_pages",
        quick=args.quick,
        question="PDF pages to PNG images (1288 px longest side)",
        baseline="pdftoppm -png -scale-to 1288, 2 processes over page ranges, process start included",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            labels, [rounded(rate[a]) for a in labels], "pages/s (2 processes)", f"Q1 PDF pages ({pages} p.)"
        ),
        notes=notes,
    )


if __name__ == "__main__":
    main()
