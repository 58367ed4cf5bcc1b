"""Q8. Scale: the ingest stage's time against the work, from small to large inputs.

Pages: report PDFs of 10 to 2,000 pages (quick: 10 to 200), rendered at 1288 px, through the
embedded ingest stage (render, hash, PNG, store, unit rows in SQLite), each run in a fresh home
so no image is deduplicated from an earlier run. Videos: 10 s to 10 minutes (quick: to 2 min),
sampled with the defaults (1 fps, at most 64 frames spread over the whole video) and with
`--num-frames 32`. The check: no step of a curve grows faster than linearly (time ratio over
work ratio at most 1.1 between consecutive sizes, i.e. within noise of linear).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from bench.common import Check, arguments, lines, median, rounded, timed, write_result
from bench.embedded import run_staged, runtime
from bench.media import report_pdf, video
from bench.models import bench_model
from ingest.spec import IngestOptions, JobSpec

CURVES = {
    "pages": {"quick": [10, 50, 200], "full": [10, 100, 500, 2000]},
    "video seconds": {"quick": [10, 60, 120], "full": [10, 60, 120, 600]},
}


def ingest_seconds(model: Path, source: Path, options: IngestOptions) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        rt = runtime(Path(tmp), model)
        seconds, _ = timed(
            lambda: run_staged(rt, [source], JobSpec(prompts=["p"], ingest=options), ("ingest",))
        )
        rt.close()
    return seconds


def worst_step(work: list[float], seconds: list[float]) -> float:
    """Largest (time ratio / work ratio) between consecutive sizes: 1.0 is linear, below is better."""
    return max((seconds[i + 1] / seconds[i]) / (work[i + 1] / work[i]) for i in range(len(work) - 1))


def exponent(work: list[float], seconds: list[float]) -> float:
    """Least-squares slope of log(time) on log(work): time grows as work ** exponent."""
    xs, ys = [math.log(w) for w in work], [math.log(s) for s in seconds]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    args = arguments(__doc__, default_reps=2, quick_reps=2)
    mode = "quick" if args.quick else "full"
    model = bench_model("tiny")
    with tempfile.TemporaryDirectory(prefix="bench-scale-warm-") as tmp:
        runtime(Path(tmp), model).close()  # imports and first loads, outside the timed runs
    curves: dict[str, dict] = {}
    pages = CURVES["pages"][mode]
    durations = CURVES["video seconds"][mode]
    cases = {
        "PDF pages at 1288 px": (pages, lambda n: (report_pdf(n), IngestOptions())),
        "video, defaults (1 fps, <= 64 frames)": (durations, lambda s: (video(s), IngestOptions())),
        "video, 32 frames": (durations, lambda s: (video(s), IngestOptions(num_frames=32))),
    }
    if args.quick:  # the default-options video curve in full mode only
        del cases["video, defaults (1 fps, <= 64 frames)"]
    for name, (sizes, make) in cases.items():
        runs: dict[int, list[float]] = {n: [] for n in sizes}
        for _rep in range(args.reps):
            for n in sizes:
                source, options = make(n)
                runs[n].append(ingest_seconds(model, source, options))
        med = [median(runs[n]) for n in sizes]
        curves[name] = {
            "work": sizes,
            "seconds": {n: [round(x, 3) for x in runs[n]] for n in sizes},
            "median_s": [round(x, 3) for x in med],
            "worst_step": rounded(worst_step(sizes, med)),
            "exponent": rounded(exponent(sizes, med)),
        }
    checks = [
        Check(
            f"{name}: worst step, time ratio / work ratio",
            c["worst_step"],
            "<=",
            1.1,
            note=f"growth exponent {c['exponent']} over {c['work'][0]}..{c['work'][-1]}",
        )
        for name, c in curves.items()
    ]
    series = [
        {"label": name, "x": c["work"], "y": c["median_s"], "axis": "pages" if "pages" in name else "video s"}
        for name, c in curves.items()
    ]
    write_result(
        "scale",
        quick=args.quick,
        question="Scale: ingest time against work",
        baseline="linear growth (the same stage on smaller inputs)",
        reps=args.reps,
        checks=checks,
        figures={"curves": curves},
        chart=lines(series, "pages / video seconds", "ingest seconds", "Q8 scale (log-log)", log=True),
    )


if __name__ == "__main__":
    main()
