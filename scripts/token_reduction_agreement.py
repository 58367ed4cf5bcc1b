"""How often generation with fewer visual tokens equals generation with all of them (README table).

    .venv/bin/python scripts/token_reduction_agreement.py [--bench-model lm100m | --model DIR]
        [--images 20] [--new-tokens 16] [--keeps 0.5,0.3]

Runs the transformers engine on synthetic page-like and picture-like images, two prompts each,
greedy, and compares every output with the all-tokens output, for three ways of giving the
language model the share F of each image's tokens:

* pruning  (``prune_keep=F``): the F highest-norm tokens stay (worker.tokens.pruning);
* merging  (``merge_keep=F``): the most similar neighbours are averaged until F remain
  (worker.tokens.merging);
* both     (``merge_keep=prune_keep=sqrt(F)``): merged to sqrt(F), then pruned to sqrt(F) of that,
  so the same share F reaches the language model.

Measures: outputs exactly equal to the all-tokens output, and the share of leading tokens that
agree. The models are RANDOM (no real weights are available offline): ``--bench-model lm100m``
(the default) is the benchmarks' ~100M-parameter random Qwen2-VL (bench/models.py), ``tiny`` the
test model; the table measures how much each mechanism disturbs a model, not answer quality.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = int(rng.integers(8, 17)) * 28, int(rng.integers(8, 17)) * 28
        if i % 2 == 0:  # page-like: white, lines of dark "text", a table box
            img = Image.new("RGB", (w, h), "white")
            draw = ImageDraw.Draw(img)
            for y in range(20, h - 20, 18):
                draw.text(
                    (16, y), f"Item {rng.integers(1000)}  total {rng.integers(99999) / 100:.2f}", fill="black"
                )
            draw.rectangle((w // 3, h // 2, w - 16, h - 16), outline="blue", width=2)
        else:  # picture-like: a gradient with coloured shapes
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, int(rng.integers(255)))], -1)
            img = Image.fromarray(base.astype(np.uint8))
            draw = ImageDraw.Draw(img)
            for _ in range(4):
                x0, y0 = int(rng.integers(w - 40)), int(rng.integers(h - 40))
                colour = tuple(int(c) for c in rng.integers(0, 255, 3))
                draw.ellipse((x0, y0, x0 + 40, y0 + 40), fill=colour)
        out.append(img)
    return out


PROMPTS = ["What is the invoice total?", "Describe the scene."]


def strategies(keep: float) -> dict[str, tuple[float, float]]:
    """name -> (prune_keep, merge_keep) that give the LM the share `keep` of the tokens."""
    root = math.sqrt(keep)
    return {"pruning": (keep, 1.0), "merging": (1.0, keep), "both": (root, root)}


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(outputs equal to the reference, mean share of leading tokens that agree)."""
    equal, agree = 0, []
    for a, b in zip(outputs, reference, strict=True):
        if a == b:
            equal += 1
            agree.append(1.0)
            continue
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        agree.append(n / max(1, len(b)))
    return equal, float(np.mean(agree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (instead of a bench model)")
    parser.add_argument("--bench-model", default="lm100m", help="bench/models.py: tiny, vision or lm100m")
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--keeps", default="0.5,0.3", help="shares of the tokens given to the LM")
    args = parser.parse_args()
    from worker.engines import EngineRequest, make_engine
    from worker.models import ModelRef, load_adapter

    model = args.model
    if model is None:
        from bench.models import bench_model

        model = str(bench_model(args.bench_model))
    started = time.perf_counter()
    adapter = load_adapter(ModelRef(model, device="cpu", dtype="float32"))
    engine = make_engine("transformers", adapter)
    visuals = adapter.encode(images(args.images))

    def run(prune_keep: float, merge_keep: float) -> tuple[list[list[int]], int]:
        requests = [
            EngineRequest(
                prompt_ids=adapter.prompt_ids(prompt, v),
                visual=v,
                cache_key=f"{i}",
                max_new_tokens=args.new_tokens,
                prune_keep=prune_keep,
                merge_keep=merge_keep,
            )
            for i, v in enumerate(visuals)
            for prompt in PROMPTS
        ]
        generations = []
        for start in range(0, len(requests), 8):
            generations += engine.generate(requests[start : start + 8])
        to_lm = sum(
            r.visual.num_tokens - g.pruned_tokens - g.merged_tokens
            for r, g in zip(requests, generations, strict=True)
        )
        return [g.token_ids for g in generations], to_lm

    reference, full_tokens = run(1.0, 1.0)
    keeps = [float(k) for k in args.keeps.split(",")]
    rows = []
    for keep in keeps:
        cells = []
        for prune_keep, merge_keep in strategies(keep).values():
            outputs, to_lm = run(prune_keep, merge_keep)
            equal, agree = agreement(outputs, reference)
            cells.append(
                f"{equal}/{len(reference)} ({equal / len(reference):.0%}), {agree:.0%} "
                f"({to_lm / full_tokens:.2f})"
            )
        rows.append(f"| {keep:.2f} | " + " | ".join(cells) + " |")
    tokens = sum(v.num_tokens for v in visuals) / len(visuals)
    print(
        f"model {Path(model).name} ({adapter.family}), {len(visuals)} images x {len(PROMPTS)} prompts, "
        f"{tokens:.0f} visual tokens per image on average, {args.new_tokens} greedy tokens, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(
        "each cell: outputs equal to all tokens, leading tokens that agree (share of visual tokens to the LM)"
    )
    print("| kept | pruning | merging | both (merge then prune, sqrt each) |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
