"""Q4. Packing by token count against fixed-size batches in arrival order.

The same requests go through the same TransformersEngine twice: once packed as the engine packs
its queue (`pack_by_tokens` over the requests' token counts), once in fixed-size batches in the
order they arrived; each batch is one static `generate` call. The fixed size is the packed plan's
mean batch size, so both arms run about the same number of batches. Requests mix page and frame
sizes (A4 and landscape pages rendered at 644 px, 640x360 and 320x240 frames) and two prompts,
shuffled as they arrive in the fleet from many jobs at once. Visual tokens are random embeddings
of the exact shape each image gets (the tower is not what is measured here). The model is the
~100M-parameter random Qwen2-VL of bench/models.py, so compute dominates on a CPU as it does on a
GPU.
"""

from __future__ import annotations

import random

import torch

from bench.common import Check, arguments, bars, interleaved, median, paired_ratio, rounded, write_result
from bench.embedded import quiet
from bench.models import bench_model, parameter_count
from worker.engines.base import EngineRequest
from worker.engines.transformers_engine import TransformersEngine
from worker.models import ModelRef, load_adapter
from worker.tokens.packing import Batch, PackItem, pack_by_tokens, padding_waste
from worker.tokens.tensors import VisualTokens

# (name, width, height, share of the images)
SIZES = [
    ("A4 page", 455, 644, 4),
    ("landscape page", 644, 498, 2),
    ("frame 640x360", 640, 360, 3),
    ("frame 320x240", 320, 240, 3),
]
PROMPTS = ["Describe this image.", "List every number you can read, with its label, as a table."]
NEW_TOKENS = 16


def random_tokens(adapter, images: dict[str, tuple[int, int]]) -> dict[str, VisualTokens]:
    """Random embeddings of each image's exact token shape (the processor's resize rule)."""
    gen = torch.Generator().manual_seed(0)
    patch = adapter.processor.image_processor.patch_size
    tokens = {}
    for key, (width, height) in images.items():
        w, h = adapter.token_rule.resized(width, height)
        grid = torch.tensor([[1, h // patch, w // patch]], dtype=torch.int64)
        n = int(grid.prod()) // adapter.merge_size**2
        tokens[key] = VisualTokens(torch.randn(n, adapter.hidden_size, generator=gen), grid)
    return tokens


def make_requests(adapter, images: int) -> list[EngineRequest]:
    """Requests from many jobs as they arrive: image sizes mixed, two prompts each, shuffled."""
    weights = [s[3] for s in SIZES]
    rng = random.Random(0)
    sizes = {}
    for i in range(images):
        name, width, height, _ = rng.choices(SIZES, weights)[0]
        sizes[f"img-{i}-{name}"] = (width, height)
    tokens = random_tokens(adapter, sizes)
    requests = [
        EngineRequest(
            prompt_ids=adapter.prompt_ids(prompt, visual),
            visual=visual,
            cache_key=key,
            max_new_tokens=NEW_TOKENS,
        )
        for key, visual in tokens.items()
        for prompt in PROMPTS
    ]
    rng.shuffle(requests)
    return requests


def items_of(requests: list[EngineRequest]) -> list[PackItem[EngineRequest]]:
    """What the engine packs (TransformersEngine._next_batch builds the same items)."""
    return [
        PackItem(payload=r, input_tokens=len(r.prompt_ids), max_new_tokens=r.max_new_tokens,
                 group=r.sampling_key, affinity=r.cache_key)
        for r in requests
    ]  # fmt: skip


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=2)
    images = 4 if args.quick else 12
    quiet()
    folder = bench_model("lm100m")
    adapter = load_adapter(ModelRef(str(folder), device="cpu"))
    requests = make_requests(adapter, images)
    engine = TransformersEngine(adapter)
    items = items_of(requests)
    packed = pack_by_tokens(items, batch_tokens=16384, max_batch_size=16)
    size = max(1, round(len(requests) / len(packed)))
    fixed = [Batch(items[i : i + size]) for i in range(0, len(items), size)]
    plans = {"packed by tokens": packed, f"fixed {size}, arrival order": fixed}
    new_tokens: dict[str, list[int]] = {name: [] for name in plans}

    def arm(name):
        def go(_rep: int) -> None:
            outputs = [g for batch in plans[name] for g in engine.generate([i.payload for i in batch.items])]
            assert not any(g.error for g in outputs), [g.error for g in outputs if g.error]
            new_tokens[name].append(sum(len(g.token_ids) for g in outputs))

        return go

    engine.generate([i.payload for i in packed[0].items])  # warm-up (first-call allocations), untimed
    seconds = interleaved({name: arm(name) for name in plans}, args.reps)
    names = list(plans)
    speedup = paired_ratio(seconds[names[1]], seconds[names[0]])
    waste = {name: padding_waste(plans[name]) for name in names}
    figures = {
        "model_parameters_m": round(parameter_count(folder) / 1e6, 1),
        "requests": len(requests),
        "batches": {name: len(plans[name]) for name in names},
        "batch_sizes": {name: [len(b.items) for b in plans[name]] for name in names},
        "input_tokens_real": sum(b.real_input_tokens for b in packed),
        "input_tokens_padded": {name: sum(b.padded_input_tokens for b in plans[name]) for name in names},
        "padding_waste": {name: round(w, 4) for name, w in waste.items()},
        "timings": seconds.rounded(),
        "requests_per_s": {name: rounded(len(requests) / median(s)) for name, s in seconds.items()},
        "new_tokens": new_tokens,
        "speedup": rounded(speedup),
    }
    checks = [
        Check("padding waste, packed", round(waste[names[0]] * 100, 2), "<=", 5.0, unit="%"),
        Check(f"generate throughput, packed / fixed batches of {size}", rounded(speedup), ">=", 1.3),
    ]
    write_result(
        "packing",
        quick=args.quick,
        question="Packing generate batches by token count",
        baseline=f"fixed-size batches ({size}) in arrival order, same requests, same engine",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            names,
            [figures["requests_per_s"][n] for n in names],
            "requests/s",
            f"Q4 packing (waste {waste[names[0]]:.1%} vs {waste[names[1]]:.1%})",
        ),
        notes=[f"padding waste of the fixed-size arm: {waste[names[1]]:.1%}"],
    )


if __name__ == "__main__":
    main()
