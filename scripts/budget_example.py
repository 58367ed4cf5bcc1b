"""The README's worked example: a 100-page PDF and a 10-minute video at each detail level.

    .venv/bin/python scripts/budget_example.py [--throughput 20000tok/s] [--gpu-cost-per-hour 2.5]

Generates the inputs (A4 pages; a 10-minute 1280x720 clip at 1 fps), writes the real
Qwen2-VL-2B-Instruct config values into a local model folder (config.json and
preprocessor_config.json only: no weights, no tokenizer, no hub), and runs the planner for each
detail level. Prompt tokens are then estimated (no tokenizer), which the table says.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import av
import numpy as np
import pymupdf

from ingest.budget import VisualBudget
from ingest.spec import JobSpec, Sampling
from worker.planning.planner import Throughput, load_plan_model, plan_job

QWEN2_VL_2B = {
    "model_type": "qwen2_vl",
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
}
QWEN2_VL_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}
PROMPT = "What is the invoice total?"
MAX_NEW_TOKENS = 128


def write_pdf(path: Path, pages: int = 100) -> Path:
    doc = pymupdf.open()
    for n in range(pages):
        page = doc.new_page(width=595, height=842)  # A4 in points
        page.insert_text((72, 72), f"Invoice page {n + 1}: total 1234.50 EUR", fontsize=14)
    doc.save(str(path))
    doc.close()
    return path


def write_video(path: Path, seconds: int = 600, size=(1280, 720)) -> Path:
    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=1)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds):
            frame = np.full((height, width, 3), (i * 3) % 255, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--throughput", default="20000tok/s")
    parser.add_argument("--gpu-cost-per-hour", type=float, default=2.5)
    args = parser.parse_args()
    rate = Throughput.parse(args.throughput)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = root / "qwen2-vl-2b-config"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(QWEN2_VL_2B))
        (model_dir / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_PREPROCESSOR))
        pdf = write_pdf(root / "report.pdf")
        video = write_video(root / "talk.mp4")
        model = load_plan_model(str(model_dir))
        budgets = {
            "model default": VisualBudget(),
            "high": VisualBudget(detail="high"),
            "medium": VisualBudget(detail="medium"),
            "low": VisualBudget(detail="low"),
            "auto (this prompt: high)": VisualBudget(detail="auto"),
            "low + --max-tokens-per-video 8192": VisualBudget(detail="low", max_tokens_per_video=8192),
        }
        print(
            f"model: Qwen2-VL-2B config (28 layers, 2 KV heads, head dim 128: "
            f"{model.kv.bytes_per_token(2):,} KV bytes per token in bf16); prompt {PROMPT!r}, "
            f"max {MAX_NEW_TOKENS} new tokens; assumed {rate.value:g} {rate.unit}, "
            f"${args.gpu_cost_per_hour}/GPU-hour"
        )
        print(
            "| detail | PDF: tokens/page | PDF: visual tokens | video: tokens/frame | video: visual tokens "
            "| KV per request (page / frame) | GPU-hours | cost | $ per million pages+frames |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for name, budget in budgets.items():
            spec = JobSpec(prompts=[PROMPT], sampling=Sampling(max_new_tokens=MAX_NEW_TOKENS), budget=budget)
            plan = plan_job(
                [pdf, video], spec, model, throughput=rate, gpu_cost_per_hour=args.gpu_cost_per_hour
            )
            p, v = plan.sources
            print(
                f"| {name} | {p.visual_tokens_max:,} | {p.visual_tokens:,} | {v.visual_tokens_max:,} "
                f"| {v.visual_tokens:,} ({v.units} frames) "
                f"| {p.kv_bytes_per_request / 2**20:.1f} / {v.kv_bytes_per_request / 2**20:.1f} MiB "
                f"| {plan.gpu_hours:.4f} | ${plan.cost_usd:.3f} | ${plan.cost_per_million_pages_usd:,.0f} |"
            )
        print(f"prompt tokens estimated (no tokenizer): {plan.prompt_tokens_estimated}")


if __name__ == "__main__":
    main()
