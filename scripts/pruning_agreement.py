"""How often pruned generation equals unpruned generation, per kept fraction (README table).

    .venv/bin/python scripts/pruning_agreement.py [--model DIR] [--images 20] [--new-tokens 16]

Runs the transformers engine on synthetic page-like and picture-like images, two prompts each,
greedy, at several `prune_keep` fractions, and compares every output with the keep=1.0 output:
exactly equal, and the share of leading tokens that agree. Without --model it builds the tiny
RANDOM model, whose agreement says little about a real model (no real weights are available
offline): the table measures the mechanism, not the quality.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from worker.engines import EngineRequest, make_engine
from worker.models import ModelRef, load_adapter

PROMPTS = ["What is the invoice total?", "Describe the scene."]
KEEPS = [1.0, 0.75, 0.5, 0.25]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: build the tiny random one)")
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from worker.models.tiny import write_tiny_model

            model = str(write_tiny_model(Path(tmp) / "tiny"))
        adapter = load_adapter(ModelRef(model, device="cpu", dtype="float32"))
        engine = make_engine("transformers", adapter)
        visuals = adapter.encode(images(args.images))
        outputs: dict[float, list[list[int]]] = {}
        for keep in KEEPS:
            requests = [
                EngineRequest(
                    prompt_ids=adapter.prompt_ids(prompt, v.num_tokens),
                    visual=v,
                    cache_key=f"{i}",
                    max_new_tokens=args.new_tokens,
                    prune_keep=keep,
                )
                for i, v in enumerate(visuals)
                for prompt in PROMPTS
            ]
            generations = []
            for start in range(0, len(requests), 8):
                generations += engine.generate(requests[start : start + 8])
            outputs[keep] = [g.token_ids for g in generations]
        tokens = sum(v.num_tokens for v in visuals) / len(visuals)
        print(
            f"{len(visuals)} images x {len(PROMPTS)} prompts, {tokens:.0f} visual tokens per image on average"
        )
        print("| kept | outputs equal to keep=1.0 | leading tokens that agree |")
        print("|---|---|---|")
        reference = outputs[1.0]
        for keep in KEEPS:
            equal = sum(a == b for a, b in zip(outputs[keep], reference, strict=True))
            agree = []
            for a, b in zip(outputs[keep], reference, strict=True):
                n = next(
                    (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
                )
                agree.append(n / max(1, len(b)) if a != b else 1.0)
            total = len(reference)
            print(f"| {keep:.2f} | {equal}/{total} ({equal / total:.0%}) | {np.mean(agree):.0%} |")


if __name__ == "__main__":
    main()
