"""Q3. The visual-token cache: the same job run cold (empty cache), then warm (same cache).

Each repetition starts from an empty home (database, image store, token cache), runs the job
once cold and once warm in the same process (weights already loaded), and times the encode
stage of each. Results of the two runs must be identical (greedy decoding, same tokens).
Inputs: a report PDF rendered at 1288 px and a 10 s video at 1 fps (640x360 frames).

The model's tower is 2 blocks, 128 wide (`bench/models.py`): a real Qwen2-VL-2B tower (32 blocks,
1280 wide) is far costlier per image, while a cache hit costs the same: the ratio is a lower bound.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import Check, arguments, bars, median, paired_ratio, rounded, write_result
from bench.embedded import answers, run_staged, runtime
from bench.media import report_pdf, video
from bench.models import bench_model
from ingest.spec import JobSpec, Sampling

PROMPTS = ["What is on this page?", "Is there a table? Answer yes or no."]


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=2)
    pages = 2 if args.quick else 12
    paths = [report_pdf(pages, variant="cache"), video(10)]
    model = bench_model("vision")
    spec = JobSpec(prompts=PROMPTS, sampling=Sampling(max_new_tokens=8))
    cold: list[float] = []
    warm: list[float] = []
    identical: list[bool] = []
    hits: list[int] = []
    units = 0
    for _rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
            rt = runtime(Path(tmp), model)
            job_cold, t_cold = run_staged(rt, paths, spec)
            job_warm, t_warm = run_staged(rt, paths, spec)
            cold.append(t_cold["encode"])
            warm.append(t_warm["encode"])
            a, b = answers(rt, job_cold), answers(rt, job_warm)
            identical.append(bool(a) and a == b)
            summary = repo_summary(rt, job_warm)
            hits.append(summary["cache_hits"])
            units = summary["units_total"]
            rt.close()
    speedup = paired_ratio(cold, warm)
    checks = [
        Check("encode stage, cold / warm", rounded(speedup), ">=", 10.0),
        Check(
            "identical results cold and warm (repetitions that matched)",
            float(sum(identical)),
            ">=",
            float(args.reps),
            unit=f"/{args.reps}",
        ),
    ]
    figures = {
        "units": units,
        "pages": pages,
        "video_frames": units - pages,
        "encode_seconds": {"cold": [round(x, 3) for x in cold], "warm": [round(x, 4) for x in warm]},
        "ms_per_unit": {
            "cold": rounded(median(cold) / units * 1000),
            "warm": rounded(median(warm) / units * 1000),
        },
        "warm_cache_hits": hits,
        "identical": identical,
    }
    write_result(
        "token_cache",
        quick=args.quick,
        question="The visual-token cache (encode stage)",
        baseline="the same job run cold (empty cache), same process, weights loaded",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            ["cold", "warm"],
            [figures["ms_per_unit"]["cold"], figures["ms_per_unit"]["warm"]],
            "encode ms per page/frame",
            "Q3 token cache",
            log=True,
        ),
    )


def repo_summary(rt, job_id: str) -> dict:
    from storage import repository as repo

    return repo.job_summary(rt.db, job_id)


if __name__ == "__main__":
    main()
