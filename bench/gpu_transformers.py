"""transformers on a GPU: encode pages/s at 1288 px and generate throughput, 7B-shaped random Qwen2-VL.

The model has Qwen2-VL-7B's real shape (LM: hidden 3584, 28 layers, 28 heads, 4 KV heads,
intermediate 18944, vocabulary 152064; tower: 32 blocks, 1280 wide, MLP ratio 4), random
weights in bf16, built in GPU memory (nothing is downloaded, nothing large is written to disk).
The product's own code paths run: `adapter.encode` (processor + tower) and the TransformersEngine's
step loop, which packs its queue by `pack_by_tokens` under the default cap of tokens per batch
(VISBATCH_TOKEN_BUDGET).

    python bench/gpu_transformers.py                # on the GPU machine (H200: a few minutes)
    python bench/gpu_transformers.py --tiny         # smoke test on CPU: tiny model, few pages

Needs this repository installed with its dependencies (torch with CUDA). While it runs,
`nvidia-smi` is sampled every 200 ms; the JSON gives GPU utilisation and memory per phase.
Writes the JSON to --out (default bench/results/gpu_transformers.json; with --tiny,
bench/.cache/gpu_transformers_tiny.json) and to $OUT/gpu_transformers.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import machine  # noqa: E402
from bench.media import CACHE, report_pdf  # noqa: E402
from ingest.pdf import render_pdf_pages  # noqa: E402
from ingest.units import RenderedImage  # noqa: E402
from worker.engines.base import EngineRequest  # noqa: E402
from worker.engines.transformers_engine import TransformersEngine  # noqa: E402
from worker.models import ModelRef, load_adapter  # noqa: E402
from worker.models.tiny import CHAT_TEMPLATE, build_tokenizer, tiny_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE_7B = {
    "hidden_size": 3584,
    "layers": 28,
    "heads": 28,
    "kv_heads": 4,
    "intermediate_size": 18944,
    "vision_depth": 32,
    "vision_embed_dim": 1280,
    "vision_heads": 16,
}
VOCAB_7B = 152064
PROMPTS = ["What is the invoice total?", "Summarise this page in one sentence."]


def model_folder(shape: dict, vocab: int | None, vision_mlp_ratio: int | None) -> tuple[Path, object]:
    """Config, tokenizer and processor in a folder (no weights); the config to build the model from."""
    from transformers import GenerationConfig, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    folder = Path(tempfile.mkdtemp(prefix="gpu-bench-model-"))
    tokenizer = build_tokenizer()
    config = tiny_config(tokenizer, **shape)
    if vocab:
        config.text_config.vocab_size = vocab
    if vision_mlp_ratio:
        config.vision_config.mlp_ratio = vision_mlp_ratio
    config.save_pretrained(folder)
    GenerationConfig(
        eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
        do_sample=False,
    ).save_pretrained(folder)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder, config


def random_model(config, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights, initialised directly on the device."""
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
        do_sample=False,
    )
    return model.eval()


class GpuSampler:
    """`nvidia-smi -lms` in the background: (time, utilisation %, memory MiB) samples."""

    def __init__(self, every_ms: int = 200) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._proc = None
        try:
            self._proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=utilization.gpu,memory.used",
                    "--format=csv,noheader,nounits",
                    f"-lms={every_ms}",
                    "-i",
                    "0",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                util, mem = (float(x) for x in line.strip().split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), util, mem))

    def phase(self, start: float, end: float) -> dict | None:
        window = [(u, m) for t, u, m in self.samples if start <= t <= end]
        if not window:
            return None
        utils = [u for u, _ in window]
        return {
            "samples": len(window),
            "util_mean_pct": round(statistics.fmean(utils), 1),
            "util_median_pct": statistics.median(utils),
            "memory_max_mib": max(m for _, m in window),
        }

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tiny", action="store_true", help="tiny random model on CPU: a smoke test, not a figure"
    )
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    ap.add_argument("--pages", type=int, default=None, help="pages encoded (default 64; 4 with --tiny)")
    ap.add_argument(
        "--batch-images", type=int, default=8, help="images per tower call (VISBATCH_ENCODE_BATCH_IMAGES)"
    )
    ap.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 64; 8 with --tiny)")
    ap.add_argument("--token-budget", type=int, default=16384, help="VISBATCH_TOKEN_BUDGET")
    ap.add_argument("--max-batch-size", type=int, default=16, help="VISBATCH_MAX_BATCH_SIZE")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = args.device or ("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    pages = args.pages or (4 if args.tiny else 64)
    new_tokens = args.new_tokens or (8 if args.tiny else 64)
    shape = {} if args.tiny else SHAPE_7B
    report: dict = {
        "script": "bench/gpu_transformers.py",
        "tiny": args.tiny,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "dtype": str(dtype),
        "shape": shape or "tiny (worker/models/tiny.py defaults)",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    sampler = GpuSampler()
    try:
        folder, config = model_folder(shape, None if args.tiny else VOCAB_7B, None if args.tiny else 4)
        started = time.perf_counter()
        model = random_model(config, device, dtype)
        sync(device)
        report["model"] = {
            "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
            "build_seconds": round(time.perf_counter() - started, 1),
        }
        adapter = load_adapter(ModelRef(str(folder), device=device, dtype=str(dtype).removeprefix("torch.")))
        adapter.__dict__["model"] = model  # the adapter's lazily loaded model, built above instead

        # Pages rendered at 1288 px (CPU; timed apart), then encoded: processor + tower.
        t0 = time.perf_counter()
        images = [u.image for u in render_pdf_pages(report_pdf(pages)) if isinstance(u, RenderedImage)]
        report["render_pages_per_s_cpu_1_process"] = round(pages / (time.perf_counter() - t0), 1)
        adapter.encode(images[: min(2, len(images))])  # warm-up: kernels, allocator
        sync(device)
        t0 = time.perf_counter()
        visuals = []
        for i in range(0, len(images), args.batch_images):
            visuals += adapter.encode(images[i : i + args.batch_images])
        sync(device)
        t1 = time.perf_counter()
        report["encode"] = {
            "pages": len(images),
            "size": list(images[0].size),
            "visual_tokens_per_page": visuals[0].num_tokens,
            "batch_images": args.batch_images,
            "seconds": round(t1 - t0, 2),
            "pages_per_s": round(len(images) / (t1 - t0), 2),
            "gpu": sampler.phase(t0, t1),
        }

        # Generation from the cached tokens, as the generate stage runs it: every request queued
        # in the engine, which packs them by tokens into static batches, step after step.
        engine = TransformersEngine(
            adapter, batch_tokens=args.token_budget, max_batch_size=args.max_batch_size
        )
        requests = [
            EngineRequest(
                prompt_ids=adapter.prompt_ids(prompt, vt), visual=vt, cache_key=f"page-{i}",
                max_new_tokens=new_tokens,
            )
            for i, vt in enumerate(visuals)
            for prompt in PROMPTS
        ]  # fmt: skip
        engine.generate(requests[: args.max_batch_size])  # warm-up
        sync(device)
        t0 = time.perf_counter()
        for i, request in enumerate(requests):
            engine.add(str(i), request)
        rows = []
        while engine.unfinished:
            rows += [generation for _, generation in engine.step()]
        sync(device)
        t1 = time.perf_counter()
        generated = sum(len(g.token_ids) for g in rows)
        prompt_tokens = sum(len(r.prompt_ids) for r in requests)
        report["generate"] = {
            "requests": len(requests),
            "batches": engine.batches_run - 1,
            "batch_tokens": args.token_budget,
            "max_batch_size": args.max_batch_size,
            "padding_waste": round(engine.padding_slots / max(1, engine.input_slots), 4),
            "errors": sum(g.error is not None for g in rows),
            "seconds": round(t1 - t0, 2),
            "requests_per_s": round(len(requests) / (t1 - t0), 2),
            "new_tokens_per_s": round(generated / (t1 - t0), 1),
            "prompt_tokens_per_s": round(prompt_tokens / (t1 - t0), 1),
            "gpu": sampler.phase(t0, t1),
        }
        if device.startswith("cuda"):
            report["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    finally:
        sampler.close()
    text = json.dumps(report, indent=2)
    print(text)
    out = args.out or (
        CACHE / "gpu_transformers_tiny.json" if args.tiny else RESULTS / "gpu_transformers.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_transformers.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
