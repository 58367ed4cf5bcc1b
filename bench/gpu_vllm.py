"""vLLM on a GPU: cached-embedding equivalence and throughput, embeddings vs raw images, in one run.

Needs on the GPU machine (nothing there reaches the network):
  * this repository, installed (`pip install --no-deps -e .` into an env that has its deps);
  * vLLM for CUDA (`vllm==0.33.*`, the `gpu` extra) with its torch, installed from wheels
    brought along (the vLLM wheel alone is several hundred MB: pre-install it, do not carry it);
  * no model download: a random Qwen2-VL of a realistic LM shape is built offline here.

    python bench/gpu_vllm.py                       # H200: well under 8 minutes
    python bench/gpu_vllm.py --device cpu --images 4 --prompts 2 --hidden 128 --layers 2   # smoke test

Prints one JSON object (and writes it to $OUT/gpu_vllm.json when OUT is set):
  equivalence  greedy tokens of the vLLM engine (cached embeddings) vs the transformers engine
               (cached embeddings, itself proven equal to pixels) on the same requests;
  embeds       the vLLM engine fed cached embeddings (vision tower never loaded), requests/s, tokens/s;
  images       a vLLM LLM fed the raw images (its own tower runs), the same requests;
  encode       the one-off cost of filling the cache (our tower, batched).
The vision tower of the random model is small (2 blocks), so `images` is a lower bound on
what a real tower costs; the LM side is what the shape flags make it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engines import EngineRequest  # noqa: E402
from worker.engines.transformers_engine import TransformersEngine  # noqa: E402
from worker.engines.vllm_engine import VLLMEngine, VLLMOptions  # noqa: E402
from worker.models import ModelRef, load_adapter  # noqa: E402
from worker.models.tiny import write_tiny_model  # noqa: E402

PROMPTS = ["What is the invoice total?", "Who is the vendor?", "What is the date?", "Is there a table?"]
# Page-like and frame-like sizes: 1288 px longest side (olmOCR's rendering) and 720p frames.
SIZES = [(1288, 911), (911, 1288), (1280, 720), (640, 480)]


def _images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        for w, h in (SIZES[i % len(SIZES)] for i in range(n))
    ]


def _requests(adapter, visuals, keys, prompts, new_tokens) -> list[EngineRequest]:
    # Prompts over one image stay adjacent, as the packer sends them (prefix-cache friendly).
    return [
        EngineRequest(adapter.prompt_ids(p, vt), vt, key, max_new_tokens=new_tokens)
        for vt, key in zip(visuals, keys, strict=True)
        for p in prompts
    ]


def _raw_image_throughput(
    model_dir: Path, dtype: str, options: VLLMOptions, adapter, images, prompts, new_tokens
):
    """A plain vLLM LLM, tower loaded, fed the pixels: what the cache saves."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        limit_mm_per_prompt={"image": 1, "video": 0},
        enable_prefix_caching=True,
        **options.llm_kwargs(),
    )
    messages = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p}]}] for p in prompts
    ]
    texts = [
        adapter.processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages
    ]
    batch = [{"prompt": t, "multi_modal_data": {"image": img}} for img in images for t in texts]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    llm.generate(batch[:2], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    llm.llm_engine.engine_core.shutdown()
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512, help="LM width (head_dim = hidden/2 must be <= 256)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--equivalence", type=int, default=16, help="requests compared token for token")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    args = ap.parse_args()

    on_gpu = args.device.startswith("cuda")
    dtype = "bfloat16" if on_gpu else "float32"
    model_dir = write_tiny_model(
        Path(tempfile.mkdtemp()) / "model", hidden_size=args.hidden, layers=args.layers
    )
    adapter = load_adapter(ModelRef(str(model_dir), device=args.device, dtype=dtype))
    options = VLLMOptions(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=8192)
    prompts = PROMPTS[: args.prompts]
    report: dict = {"device": args.device, "dtype": dtype, "hidden": args.hidden, "layers": args.layers}

    images = _images(args.images)
    started = time.perf_counter()
    visuals = [vt for i in range(0, len(images), 16) for vt in adapter.encode(images[i : i + 16])]
    report["encode"] = {"images": len(images), "seconds": round(time.perf_counter() - started, 2)}
    keys = [f"bench-{i}" for i in range(len(images))]
    requests = _requests(adapter, visuals, keys, prompts, args.new_tokens)

    engine = VLLMEngine(adapter, options)
    started = time.perf_counter()
    engine.llm  # noqa: B018
    report["vllm_start_seconds"] = round(time.perf_counter() - started, 1)

    sample = requests[: args.equivalence]
    ours, ref = engine.generate(sample), TransformersEngine(adapter).generate(sample)
    same = [a.token_ids == b.token_ids for a, b in zip(ours, ref, strict=True)]
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None)
        for a, b in zip(ours, ref, strict=True)
    ]
    # bf16 kernels differ between the engines: report where a greedy path first forks, if it does.
    report["equivalence"] = {"requests": len(sample), "identical": sum(same), "first_divergence": prefix}

    before = engine.prefix_cache_stats()
    started = time.perf_counter()
    out = engine.generate(requests)
    seconds = time.perf_counter() - started
    after = engine.prefix_cache_stats()
    tokens = sum(len(g.token_ids) for g in out)
    report["embeds"] = {
        "requests": len(requests),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(requests) / seconds, 1),
        "new_tokens_per_s": round(tokens / seconds, 1),
        "errors": sum(g.error is not None for g in out),
        "prefix_cache_hit_rate": round(
            (after["hits"] - before["hits"]) / max(1, after["queries"] - before["queries"]), 3
        ),
    }
    engine.close()

    seconds, tokens = _raw_image_throughput(
        model_dir, dtype, options, adapter, images, prompts, args.new_tokens
    )
    report["images"] = {
        "requests": len(requests),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(requests) / seconds, 1),
        "new_tokens_per_s": round(tokens / seconds, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_vllm.json").write_text(text)


if __name__ == "__main__":  # vLLM starts its engine in spawned processes: keep the guard
    main()
