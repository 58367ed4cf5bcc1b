"""Q1. PDF pages to PNG images: `visbatch ingest` against `pdftoppm -png -scale-to 1288`.

Four report-like PDFs (bench/media.py: text, a table, a vector chart per page; every page
different), 408 pages in all (40 in quick mode), rendered at a longest side of 1288 px into
one PNG file per page. Whole processes as a user runs them, start-up included, both sides on
two processes:

  * pdftoppm: for each PDF in turn, two processes at once, each over half its pages;
  * visbatch: ONE `visbatch ingest A.pdf B.pdf C.pdf D.pdf --out DIR --processes 2` (the
    pages of each PDF spread over two forked processes; PNGs, text layer, manifest), without a
    model, and the same with `--model` (the tiny model: visual-token counts from its JSON
    files, still no torch);
  * for reference, a bare PyMuPDF render + Pillow PNG (compress_level=1) loop, two processes
    per PDF like pdftoppm: what the old image path cost.

Full mode also times each arm on a 1-page PDF: the fixed cost of a start.
"""

from __future__ import annotations

import os
import shutil
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
PROCESSES = 2

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


def page_count(pdf: Path) -> int:
    import pymupdf

    with pymupdf.open(str(pdf)) as doc:
        return doc.page_count


def halves(pages: int) -> list[tuple[int, int]]:
    mid = max(1, pages // 2)
    return [(1, mid), (mid + 1, pages)] if pages > 1 else [(1, 1)]


def per_pdf_in_halves(arm: str, pdfs: list[Path], out: Path) -> None:
    """pdftoppm or the bare loop: each PDF in turn, two processes over its halves."""
    for n, pdf in enumerate(pdfs):
        (out / f"d{n}").mkdir()
        procs = []
        for first, last in halves(page_count(pdf)):
            if arm == "pdftoppm":
                argv = ["pdftoppm", "-png", "-scale-to", str(LONGEST_SIDE), "-f", str(first), "-l", str(last),
                        str(pdf), str(out / f"d{n}")]  # fmt: skip
            else:
                argv = [sys.executable, "-c", BARE_LOOP, str(pdf), str(first), str(last), str(out / f"d{n}")]
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for proc in procs:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{arm} exited {proc.returncode}: {err.decode(errors='replace')[-1500:]}")


def visbatch_ingest(pdfs: list[Path], out: Path, model: Path | None) -> None:
    argv = [VISBATCH, "ingest", *map(str, pdfs), "--out", str(out), "--longest-side", str(LONGEST_SIDE),
            "--processes", str(PROCESSES)]  # fmt: skip
    if model is not None:
        argv += ["--model", str(model)]
    env = {k: v for k, v in os.environ.items() if k != "VISBATCH_MODEL"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"visbatch ingest exited {done.returncode}: {done.stderr[-1500:]}")


def arm(name: str, pdfs: list[Path], work: Path, expected: int, model: Path):
    def go(_rep: int) -> None:
        out = Path(tempfile.mkdtemp(prefix="out-", dir=work))
        if name == "visbatch":
            visbatch_ingest(pdfs, out / "o", None)
        elif name == "visbatch --model":
            visbatch_ingest(pdfs, out / "o", model)
        else:
            per_pdf_in_halves(name, pdfs, out)
        written = len(list(out.rglob("*.png")))
        shutil.rmtree(out)
        if written != expected:
            raise RuntimeError(f"{name} wrote {written} PNGs, expected {expected}")

    return go


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=2)
    per_pdf = 10 if args.quick else 102
    pdfs = [report_pdf(per_pdf, variant=v) for v in ("a", "b", "c", "d")]
    pages = per_pdf * len(pdfs)
    model = bench_model("tiny")
    arms = ["visbatch", "visbatch --model", "bare PyMuPDF + Pillow PNG loop"]
    notes = []
    if tool("pdftoppm"):
        arms.insert(0, "pdftoppm")
    else:
        notes.append("pdftoppm is not installed (bash bench/install_baselines.sh): its baseline was skipped")
    with tempfile.TemporaryDirectory(prefix="bench-pdf-") as tmp:
        work = Path(tmp)
        seconds = interleaved({a: arm(a, pdfs, work, pages, model) for a in arms}, args.reps)
        start_seconds = None
        if not args.quick:
            one = [report_pdf(1, variant="start")]
            start_seconds = interleaved({a: arm(a, one, work, 1, model) for a in arms}, args.reps)

    rate = {a: pages / median(s) for a, s in seconds.items()}
    figures: dict = {
        "pages": pages,
        "pdfs": len(pdfs),
        "longest_side": LONGEST_SIDE,
        "processes_per_arm": PROCESSES,
        "timings": seconds.rounded(),
        "pages_per_s": {a: rounded(r) for a, r in rate.items()},
    }
    checks = []
    if "pdftoppm" in seconds:
        speedups = {
            a: rounded(paired_ratio(seconds["pdftoppm"], seconds[a])) for a in arms if a != "pdftoppm"
        }
        figures["speedup_vs_pdftoppm"] = speedups
        checks.append(
            Check(
                f"visbatch ingest pages/s vs pdftoppm ({pages} pages, {len(pdfs)} PDFs, 2 processes each)",
                speedups["visbatch"],
                ">=",
                6.0,
            )
        )
        checks.append(
            Check("the same with --model (token counts, no torch)", speedups["visbatch --model"], ">=", 6.0)
        )
    else:
        checks.append(Check("visbatch ingest pages/s vs pdftoppm", None, ">=", 6.0, note="pdftoppm missing"))
    if start_seconds is not None:
        figures["one_page_pdf_seconds"] = {a: rounded(median(s)) for a, s in start_seconds.items()}
        notes.append(
            "a 1-page PDF, whole process: "
            + ", ".join(f"{a} {median(s):.2f} s" for a, s in start_seconds.items())
        )
    if args.quick:
        notes.append(
            "quick mode: inputs too small for the targets (process start dominates); they are for full mode"
        )
    labels = list(rate)
    write_result(
        "pdf_pages",
        quick=args.quick,
        question="PDF pages to PNG images (1288 px longest side)",
        baseline="pdftoppm -png -scale-to 1288, 2 processes over each PDF's halves, process start included",
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
