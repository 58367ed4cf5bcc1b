"""Q7b. Memory of `visbatch ingest` on long inputs: peak RSS over a long source against a short one.

The command as a user runs it (`--processes 2`: the PDF's pages rendered by two forked
processes), its whole process tree sampled by psutil every 50 ms (bench.memory.PeakSampler):
  * a 2,000-page report PDF against a 200-page one (200 against 20 in quick mode);
  * a 2-hour video sampled at 1 fps with `--max-frames 10000` (7,200 frames written) against a
    10-minute one (600), tiny (160x90, 5 fps, a keyframe every 10 s) so that decoding stays
    cheap: what could pile up is per frame, not per pixel (10 minutes against 1 in quick mode).
Flat means the long source's peak is within 10% of the short one's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Check, arguments, bars, median, rounded, write_result
from bench.media import report_pdf, video
from bench.memory import MB, PeakSampler

VISBATCH = str(Path(sys.executable).with_name("visbatch"))
VIDEO_SIZE = (160, 90)


def measure(source: Path, *options: str) -> dict:
    """One `visbatch ingest` run: peak RSS of its process tree, of the main process, of a child."""
    env = {k: v for k, v in os.environ.items() if k != "VISBATCH_MODEL"}
    with tempfile.TemporaryDirectory(prefix="bench-ingest-mem-") as tmp:
        argv = [VISBATCH, "ingest", str(source), "--out", f"{tmp}/out", "--processes", "2", *options]
        started = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with PeakSampler(proc.pid) as sampler:
            _, err = proc.communicate()
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"visbatch ingest exited {proc.returncode}: {err[-1500:]}")
        units = sum(1 for _ in Path(f"{tmp}/out").rglob("*.png"))
    return {
        "peak_tree": sampler.peak_tree,
        "peak_root": sampler.peak_root,
        "peak_child": sampler.peak_children,
        "seconds": seconds,
        "units": units,
    }


def main() -> None:
    args = arguments(__doc__, default_reps=2, quick_reps=1)
    pages = (20, 200) if args.quick else (200, 2000)
    minutes = (1, 10) if args.quick else (10, 120)
    cases = {
        "pdf": {n: (report_pdf(n), (), n) for n in pages},
        "video": {
            m: (
                video(m * 60, VIDEO_SIZE, fps=5, gop_seconds=10.0),
                ("--fps", "1", "--max-frames", "10000"),
                m * 60,
            )
            for m in minutes
        },
    }
    runs: dict[str, dict[int, list[dict]]] = {
        kind: {size: [] for size in sizes} for kind, sizes in cases.items()
    }
    for _rep in range(args.reps):
        for kind, sizes in cases.items():
            for size, (source, options, expected) in sizes.items():
                run = measure(source, *options)
                if run["units"] != expected:
                    raise RuntimeError(f"{kind} {size}: {run['units']} images, expected {expected}")
                runs[kind][size].append(run)

    def peak_mb(kind: str, size: int, key: str) -> float:
        return round(median([r[key] for r in runs[kind][size]]) / MB, 1)

    units = {"pdf": "pages", "video": "minutes"}
    figures: dict = {"pdf_pages": list(pages), "video_minutes": list(minutes), "video_size": VIDEO_SIZE}
    checks, labels, values = [], [], []
    for kind, sizes in cases.items():
        small, large = sizes
        figures[kind] = {
            f"{key}_mb": {s: peak_mb(kind, s, key) for s in sizes}
            for key in ("peak_tree", "peak_root", "peak_child")
        }
        figures[kind]["seconds"] = {s: [round(r["seconds"], 1) for r in runs[kind][s]] for s in sizes}
        tree = figures[kind]["peak_tree_mb"]
        if kind == "pdf":
            what = f"visbatch ingest, {large:,} pages / {small:,} pages"
        else:
            frames = f"{large * 60:,}/{small * 60:,} frames"
            what = f"visbatch ingest --fps 1, {large} min / {small} min of video ({frames})"
        checks.append(
            Check(f"{what}: peak RSS, all processes", rounded(tree[large] / tree[small]), "<=", 1.10)
        )
        labels += [f"{kind} {small} {units[kind]}", f"{kind} {large} {units[kind]}"]
        values += [tree[small], tree[large]]
    write_result(
        "ingest_memory",
        quick=args.quick,
        question="Memory of visbatch ingest on long inputs",
        baseline="the same command on a 10x (PDF) or 12x (video) shorter input",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(labels, values, "peak RSS, all processes (MiB)", "Q7b ingest memory"),
    )


if __name__ == "__main__":
    main()
