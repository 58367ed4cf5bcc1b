"""`python -m bench.staged PATHS -p PROMPT [--detail D] [--max-new-tokens N]`: a job run one stage
after another, each to its end before the next starts (bench.embedded.run_staged), as a process:
the "before" arm of the streaming benchmark. Settings from the environment, like `visbatch run`;
prints the job id."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.embedded import quiet, run_staged
from ingest.budget import VisualBudget
from ingest.spec import JobSpec, Sampling
from visbatch.settings import Settings
from worker.runtime import Runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("-p", "--prompt", action="append", required=True)
    parser.add_argument("--detail", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    quiet()
    rt = Runtime(Settings())
    spec = JobSpec(
        prompts=args.prompt,
        sampling=Sampling(max_new_tokens=args.max_new_tokens),
        budget=VisualBudget(detail=args.detail),
    )
    job_id, _ = run_staged(rt, args.paths, spec)
    print(job_id)
    rt.close()


if __name__ == "__main__":
    main()
