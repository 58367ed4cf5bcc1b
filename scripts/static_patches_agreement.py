"""What `--drop-static D` saves on a real clip, and how often its answers equal the full window's
(docs/budget.md), measured with the commands a user runs.

    .venv/bin/python scripts/static_patches_agreement.py [--bench-model lm100m | --model DIR]
        [--clip examples/clip.mp4] [--thresholds 0.05,0.1,0.2]

One `visbatch run` of the clip in windows (`--fps 4 --keep-all-frames --window 2s`, two
prompts, 16 greedy tokens) without `--drop-static`, then one per threshold; for each, the share
of the windows' visual tokens kept out of the LM (`visbatch status --json`: saved by pruning,
where dropped static patches are counted) and `visbatch compare` against the full run (answers
exactly equal, per prompt). The models are RANDOM (no real weights offline): the tower's
embeddings of a random model change differently from a trained one's, so the saving and the
agreement say how the mechanism behaves, not what it costs a real model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What happens in this clip?", "Is anyone moving? Answer yes or no."]


def visbatch(home: Path, *args: str) -> str:
    """The command's stdout and stderr (the venv's own `visbatch`, as a user runs it)."""
    env = {**os.environ, "VISBATCH_HOME": str(home)}
    command = [str(Path(sys.executable).parent / "visbatch"), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"visbatch {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bench-model", default="lm100m", help="a model of bench/models.py")
    parser.add_argument("--model", default=None, help="a model folder (instead of --bench-model)")
    parser.add_argument("--clip", default=str(ROOT / "examples" / "clip.mp4"))
    parser.add_argument("--thresholds", default="0.05,0.1,0.2")
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from bench.models import bench_model

        args.model = str(bench_model(args.bench_model))
    home = Path(tempfile.mkdtemp(prefix="static-patches-"))
    common = [args.clip, "--model", args.model, "--fps", "4", "--keep-all-frames", "--window", "2s"]
    common += [arg for prompt in PROMPTS for arg in ("-p", prompt)] + ["--max-new-tokens", "16"]

    def run(drop_static: float) -> tuple[str, dict]:
        said = visbatch(home, "run", *common, "--drop-static", str(drop_static))
        job = re.findall(r"visbatch results ([0-9a-f]{32})", said)[-1]
        return job, json.loads(visbatch(home, "status", job, "--json"))["tokens"]

    full, _ = run(0.0)
    print(f"clip {args.clip}, model {args.model}")
    print("| --drop-static | visual tokens to the LM, over all requests | left out | equal answers |")
    print("|---|---|---|---|")
    for threshold in (float(t) for t in args.thresholds.split(",")):
        job, tokens = run(threshold)
        compared = json.loads(visbatch(home, "compare", full, job, "--json"))["prompts"]
        agree, total = sum(p["agree"] for p in compared), sum(p["compared"] for p in compared)
        given, left_out = tokens["spent"]["visual_to_lm"], tokens["saved"]["pruning"]
        whole = given + left_out
        print(
            f"| {threshold:g} | {given:,} of {whole:,} | {left_out / whole:.0%} "
            f"| {agree}/{total} ({agree / total:.0%}) |"
        )


if __name__ == "__main__":
    main()
