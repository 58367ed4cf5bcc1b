"""Q5. The fleet's own cost: the same job through the fleet and through the embedded pipeline.

Fleet: two `visbatch worker` processes on this machine, one on the ingest queue and one on
encode + generate (the CPU worker / GPU worker split of a real deployment), Celery on the local
Redis, results in PostgreSQL (a schema of its own), images and token cache in a shared folder.
The job is submitted in-process (`worker.drivers.fleet.submit.submit_job`, what `visbatch submit` calls) and
timed until its row is final. Embedded: `worker.drivers.embedded.run_job` in this process (SQLite, its
own folders), the embedded defaults. Both are warmed up first (weights loaded, one small job),
as a long-running fleet would be. Each repetition uses new PDFs (new pixels, so encode runs in
both arms); the model is the ~100M-parameter random Qwen2-VL of bench/models.py (quick mode: a
small LM, so the fleet's fixed costs weigh more there).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.common import Check, arguments, bars, interleaved, median, paired_ratio, rounded, write_result
from bench.embedded import runtime
from bench.fleet_proc import BenchFleet
from bench.media import report_pdf, video
from bench.models import bench_model
from bench.results_db import scratch_schema
from ingest.spec import IngestOptions, JobSpec, Sampling


def inputs_for(rep: int | str, quick: bool) -> list[Path]:
    docs = 1 if quick else 2
    pages = 3 if quick else 6
    return [report_pdf(pages, variant=f"fleet-{rep}-{d}") for d in range(docs)] + [video(10)]


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=2)
    model = bench_model("vision" if args.quick else "lm100m")  # quick: a small LM, a smoke figure
    prompts = ["What is on this page?"] if args.quick else ["What is on this page?", "Is there a table?"]
    frames = 3 if args.quick else 6
    spec = JobSpec(
        prompts=prompts,
        sampling=Sampling(max_new_tokens=8),
        ingest=IngestOptions(longest_side=644, num_frames=frames),
    )
    inputs = {rep: inputs_for(rep, args.quick) for rep in range(args.reps)}
    # The warm-up job has the real job's shapes (first calls of a shape cost extra on CPU), and
    # its video leaves the same cached frames in both arms.
    warmup = inputs_for("warmup", args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp, scratch_schema() as url:
        work = Path(tmp)
        fleet = BenchFleet(work, model, url)
        os.environ.update(fleet.env)  # before worker.drivers.fleet.celery_app is imported (by submit_job)
        from visbatch.settings import Settings
        from worker.drivers.embedded import run_job
        from worker.drivers.fleet.submit import submit_job
        from worker.runtime import Runtime

        try:
            fleet.start_worker("ingest")
            fleet.start_worker("encode,generate")
            client = Runtime(Settings())
            home = work / "embedded"
            embedded = runtime(
                home,
                model,
                database_url=f"sqlite:///{home}/visbatch.db",
                store_url=f"file://{home}/store",
                cache_url=f"file://{home}/token-cache",
            )
            statuses: dict[str, list[str]] = {"embedded": [], "fleet, 2 workers": []}
            results: dict[str, list[int]] = {"embedded": [], "fleet, 2 workers": []}

            def through_fleet(paths: list[Path]) -> str:
                job = submit_job(client, [str(p) for p in paths], spec)
                fleet.wait(client.db, job)
                return job

            through_fleet(warmup)
            run_job(embedded, warmup, spec)

            def arm_embedded(rep: int) -> None:
                job = run_job(embedded, inputs[rep], spec)
                _record(embedded, job, statuses["embedded"], results["embedded"])

            def arm_fleet(rep: int) -> None:
                job = through_fleet(inputs[rep])
                _record(client, job, statuses["fleet, 2 workers"], results["fleet, 2 workers"])

            times = interleaved({"embedded": arm_embedded, "fleet, 2 workers": arm_fleet}, args.reps)
            embedded.close()
            client.close()
        finally:
            fleet.close()

    per_s = {name: results[name][0] / median(times[name]) for name in times}
    ratio = paired_ratio(times["embedded"], times["fleet, 2 workers"])
    figures = {
        "results_per_job": results,
        "statuses": statuses,
        "timings": times.rounded(),
        "results_per_s": {k: rounded(v) for k, v in per_s.items()},
        "fleet_over_embedded": rounded(ratio),
        "model": model.name,
    }
    checks = [Check("fleet (2 workers) throughput / embedded", rounded(ratio), ">=", 0.85)]
    write_result(
        "fleet",
        quick=args.quick,
        question="The fleet's own cost",
        baseline="embedded run_job of the same inputs (SQLite, in-process), warmed up",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(list(per_s), [rounded(v) for v in per_s.values()], "results/s", "Q5 fleet vs embedded"),
        notes=[
            "fleet: ingest worker + encode,generate worker, Celery on Redis, PostgreSQL; "
            "embedded: one process, SQLite; same model, inputs and prompts"
        ],
    )


def _record(rt, job: str, statuses: list[str], results: list[int]) -> None:
    from storage import repository as repo

    summary = repo.job_summary(rt.db, job)
    statuses.append(summary["status"])
    results.append(summary["results"])
    if summary["status"] != "succeeded":
        raise RuntimeError(f"job {job} ended {summary['status']}: {summary.get('errors')}")


if __name__ == "__main__":
    main()
