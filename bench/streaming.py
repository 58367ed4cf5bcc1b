"""Q11. Streaming: does a page reach its answer while later pages still render, and does the job
take as long as its slowest stage rather than the sum of its stages?

Two arms, each a whole process on the same inputs (three report PDFs, 54 pages at 1288 px, one
prompt, the ~100M-parameter bench LM on the CPU, each repetition in an empty home so every page
is rendered, encoded and answered):

  streaming   `visbatch run` as a user runs it (ingest, encode and generate at once, bounded queues)
  sequential  the same stage code, each stage to its end before the next starts (`bench.staged`):
              how the embedded run worked before it streamed

Figures come from each job's row: the time to its first stored result and its wall time (from
`started_at`), and each stage's busy time (summed over the threads that worked on it).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from bench.common import Check, arguments, bars, median, paired_ratio, rounded, run, write_result
from bench.media import report_pdf
from bench.models import bench_model
from storage import repository as repo
from storage.db import Database

PROMPT = "What is on this page? Answer in one sentence."
FLAGS = ["--detail", "low", "--max-new-tokens", "24"]
VISBATCH = str(Path(sys.executable).with_name("visbatch"))


def _env(home: Path, model: Path) -> dict[str, str]:
    return {
        **os.environ,
        "VISBATCH_HOME": str(home),
        "VISBATCH_MODEL": str(model),
        "VISBATCH_DEVICE": "cpu",
        "VISBATCH_ENGINE": "transformers",
    }


def _timing(home: Path, job_id: str) -> dict:
    db = Database(f"sqlite:///{home / 'visbatch.db'}")
    try:
        summary = repo.job_summary(db, job_id)
    finally:
        db.dispose()
    assert summary["status"] == "succeeded", summary["errors"][:3]
    return summary["timing"] | {"units": summary["units_total"]}


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=1)
    pages = 4 if args.quick else 18
    paths = [str(report_pdf(pages, variant=f"stream-{i}")) for i in range(3)]
    model = bench_model("tiny" if args.quick else "lm100m")
    timings: dict[str, list[dict]] = {"streaming": [], "sequential": []}
    for rep in range(args.reps):
        order = ["streaming", "sequential"] if rep % 2 == 0 else ["sequential", "streaming"]
        for arm in order:
            with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
                home = Path(tmp)
                env = _env(home, model)
                if arm == "streaming":
                    done = run([VISBATCH, "run", *paths, "-p", PROMPT, *FLAGS], env=env, text=True)
                else:
                    argv = [sys.executable, "-m", "bench.staged", *paths, "-p", PROMPT, *FLAGS]
                    done = run(argv, env=env, text=True)
                job_id = done.stdout.strip().splitlines()[0]
                timings[arm].append(_timing(home, job_id))
                print(f"[streaming] rep {rep} {arm}: {timings[arm][-1]}", flush=True)

    def first_share(t: dict) -> float:
        return t["first_result_seconds"] / t["wall_seconds"]

    def over_busiest(t: dict) -> float:
        return t["wall_seconds"] / max(t["busy_seconds"].values())

    figures = {
        arm: {
            "first_result_share": rounded(median([first_share(t) for t in ts])),
            "wall_over_busiest_stage": rounded(median([over_busiest(t) for t in ts])),
            "wall_s": rounded(median([t["wall_seconds"] for t in ts])),
            "busy_s": {s: rounded(median([t["busy_seconds"][s] for t in ts])) for s in ts[0]["busy_seconds"]},
            "units": ts[0]["units"],
        }
        for arm, ts in timings.items()
    }
    speedup = paired_ratio(
        [t["wall_seconds"] for t in timings["sequential"]], [t["wall_seconds"] for t in timings["streaming"]]
    )
    figures["wall_sequential_over_streaming"] = rounded(speedup)
    stream = figures["streaming"]
    checks = [
        Check(
            "first stored result, share of the wall time (streaming)",
            stream["first_result_share"],
            "<=",
            0.15,
        ),
        Check(
            "wall time / busiest stage's busy time (streaming)", stream["wall_over_busiest_stage"], "<=", 1.15
        ),
    ]
    write_result(
        "streaming",
        quick=args.quick,
        question=__doc__.splitlines()[0],
        baseline="the same stages run one after another (bench.staged), same process shape",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            ["first result\n(share of wall)", "wall / busiest\nstage"],
            [stream["first_result_share"], stream["wall_over_busiest_stage"]],
            "ratio",
            f"Q11 streaming (sequential: {figures['sequential']['first_result_share']}, "
            f"{figures['sequential']['wall_over_busiest_stage']})",
        ),
        notes=[f"{len(paths)} PDFs, {stream['units']} pages; flags {' '.join(FLAGS)}; model {model.name}"],
    )


if __name__ == "__main__":
    main()
