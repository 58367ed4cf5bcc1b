"""`python -m bench [--quick] [--only NAME,...]`: every benchmark in its own process, then the report.

Each benchmark writes bench/results[/quick]/<name>.json; bench.report then draws the chart and
the summary table. A benchmark that crashes is reported and the others still run (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import ROOT, results_dir

BENCHMARKS = [
    "pdf_pages",  # Q1
    "video_frames",  # Q2
    "token_cache",  # Q3
    "packing",  # Q4
    "fleet",  # Q5
    "results_db",  # Q6
    "memory",  # Q7
    "scale",  # Q8
    "ingest_memory",  # Q9
    "image_encoding",  # Q10
    "streaming",  # Q11
    "cpu_side",  # Q13 (Q12, vllm_window, runs in the vLLM venv: make bench-vllm)
    "unit_costs",  # issue 24: what a page costs each service, counted
    "control_plane",  # issue 24: load workers raised until a service saturates
    "cache_compression",  # Q14: zstd/lz4 on cache entries (docs/scale.md; not charted)
    "hot_tier",  # Q15: a too-small cache Redis, and what one moves (docs/scale.md; not charted)
    "dead_worker",  # issue 32: a SIGKILLed GPU worker's job done how soon, Redis and RabbitMQ
    "windows",  # issue 34: a video in 10-s windows against its frames one by one
]

# Run only when named (`python -m bench db_scale`): too long for the whole suite (10M rows).
ON_DEMAND = [
    "db_scale",  # issue 24: the database at scale
]

ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("names", nargs="*", help="benchmarks to run (as --only)")
    args = parser.parse_args()
    chosen = [n for n in args.only.split(",") if n] + args.names or BENCHMARKS
    unknown = sorted(set(chosen) - set(BENCHMARKS) - set(ON_DEMAND))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    env = {**os.environ, **ENV}
    durations: dict[str, float] = {}
    failed: list[str] = []
    started = time.perf_counter()
    for name in chosen:
        print(f"== {name}{' (quick)' if args.quick else ''}", flush=True)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", f"bench.{name}"] + (["--quick"] if args.quick else [])
        if subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode != 0:
            failed.append(name)
            print(f"!! {name} failed", flush=True)
        durations[name] = round(time.perf_counter() - t0, 1)
        print(f"   {name}: {durations[name]:.0f} s", flush=True)
    total = round(time.perf_counter() - started, 1)
    run = {"quick": args.quick, "seconds": durations, "total_seconds": total, "failed": failed}
    if chosen == BENCHMARKS:  # run.json: how long the whole suite takes
        (results_dir(args.quick) / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    from bench.report import report

    report(args.quick)
    print(f"== all benchmarks: {total / 60:.1f} min{'; FAILED: ' + ', '.join(failed) if failed else ''}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
