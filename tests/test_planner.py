"""`visbatch plan` predicts what a run records: per-source visual tokens, prompt tokens, requests
and KV bytes equal those of a real embedded run of the tiny model on a PDF and a video."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from typer.testing import CliRunner

from ingest.budget import VisualBudget
from ingest.spec import IngestOptions, JobSpec, Sampling
from storage import repository as repo
from tests.media import write_pdf, write_video
from worker.cli.main import app
from worker.drivers.embedded import run_job
from worker.planning.planner import Throughput, dtype_bytes, kv_shape_from_config, load_plan_model, plan_job
from worker.runtime import Runtime

# Real Qwen2-VL-2B-Instruct values (config.json / preprocessor_config.json), for the config-only path.
QWEN2_VL_2B_CONFIG = {
    "model_type": "qwen2_vl",
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
}
QWEN2_VL_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}


@pytest.mark.slow
@pytest.mark.parametrize(
    "budget",
    [VisualBudget(), VisualBudget(detail="low", max_tokens_per_video=150)],
    ids=["model-default", "low+video-cap"],
)
def test_plan_equals_what_a_run_records(settings_factory, tiny_model_dir, tmp_path, budget):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "doc.pdf", pages=2)
    write_video(inputs / "clip.mp4", seconds=2)  # 2 frames at 1 fps, 320x240: 99 tokens each
    spec = JobSpec(
        prompts=["What is the total?", "Describe it."],
        sampling=Sampling(max_new_tokens=4),
        ingest=IngestOptions(),
        budget=budget,
    )
    settings = settings_factory(dtype="float32")
    plan = plan_job(
        [inputs], spec, load_plan_model(str(tiny_model_dir)), element_bytes=dtype_bytes("float32")
    )

    rt = Runtime(settings)
    job_id = run_job(rt, [inputs], spec)
    records = list(repo.iter_results(rt.db, job_id))
    summary = repo.job_summary(rt.db, job_id)
    rt.close()
    assert summary["status"] == "succeeded", summary["errors"]

    kv = kv_shape_from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    assert (kv.layers, kv.kv_heads, kv.head_dim) == (2, 1, 64)
    per_token = kv.bytes_per_token(4)
    assert plan.kv_bytes_per_token == per_token == 2 * 2 * 1 * 64 * 4
    by_source = defaultdict(list)
    for r in records:
        by_source[r["source"]].append(r)
    assert {s.source for s in plan.sources} == set(by_source)
    for source in plan.sources:
        rows = by_source[source.source]
        assert source.requests == len(rows)
        assert source.units == len({r["unit"] for r in rows})
        assert source.visual_tokens == sum(r["visual_tokens"] for r in rows if r["prompt_index"] == 0)
        assert source.prompt_tokens == sum(r["prompt_tokens"] for r in rows)
        # A request's KV at its end: visual + prompt + max new tokens (the cap a run reserves for).
        kv_run = max((r["visual_tokens"] + r["prompt_tokens"] + 4) * per_token for r in rows)
        assert source.kv_bytes_per_request == kv_run
    assert plan.total.visual_tokens == summary["visual_tokens"] == summary["tokens"]["spent"]["visual"]
    assert plan.total.prompt_tokens == summary["prompt_tokens"]
    if budget.detail == "low":
        video = next(s for s in plan.sources if s.kind == "video")
        assert video.visual_tokens <= 150 < 2 * 99  # the per-video cap bit
        assert summary["tokens"]["saved"]["detail"] > 0
        assert (
            summary["tokens"]["without_budget"]
            == summary["visual_tokens"] + summary["tokens"]["saved"]["detail"]
        )


def test_config_only_plan_and_cost(tmp_path):
    """No tokenizer, no weights: the resize rule and KV shape from the JSON files alone."""
    folder = tmp_path / "qwen2-vl-2b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN2_VL_2B_CONFIG))
    (folder / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_PREPROCESSOR))
    write_pdf(tmp_path / "doc.pdf", pages=3)
    model = load_plan_model(str(folder))
    assert model.prompt_tokens is None
    assert model.kv.bytes_per_token(2) == 2 * 28 * 2 * 128 * 2  # 28 KiB per token in bf16
    spec = JobSpec(prompts=["What is the invoice total?"], sampling=Sampling(max_new_tokens=100))
    plan = plan_job(
        [tmp_path / "doc.pdf"], spec, model, throughput=Throughput.parse("10000tok/s"), gpu_cost_per_hour=3.6
    )
    assert plan.prompt_tokens_estimated and plan.total.units == 3
    assert plan.total.visual_tokens == 3 * model.count_visual_tokens(911, 1288, None) == 3 * 1518
    assert plan.gpu_hours == pytest.approx(plan.total.tokens / 10000 / 3600)
    assert plan.cost_per_million_pages_usd == pytest.approx(plan.gpu_hours * 3.6 / 3 * 1e6)
    assert Throughput.parse("2.5pages/s") == Throughput(2.5, "pages/s")
    assert Throughput.parse("800") == Throughput(800.0, "tokens/s")


def test_plan_command_json(tiny_model_dir, tmp_path):
    write_pdf(tmp_path / "doc.pdf", pages=2)
    write_video(tmp_path / "clip.mp4", seconds=2)
    args = [
        "plan",
        str(tmp_path),
        "--model",
        str(tiny_model_dir),
        "--detail",
        "auto",
        "-p",
        "Describe the scene.",
    ]
    done = CliRunner().invoke(app, [*args, "--json", "--throughput", "3pages/s", "--gpu-cost-per-hour", "2"])
    assert done.exit_code == 0, done.output
    plan = json.loads(done.stdout)
    assert plan["detail"] == "low" and plan["bounds"]["max_pixels"] == 256 * 28 * 28
    assert plan["total"]["units"] == 4 and plan["total"]["requests"] == 4
    assert plan["gpu_hours"] == pytest.approx(4 / 3 / 3600)
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "doc.pdf" in table.stdout and "total" in table.stdout


def test_prompt_tokens_without_torch_equal_the_adapters(family_adapter):
    """The planner's torch-free count (tokenizer.json + the chat template in Jinja) is the count a
    run records for the Qwen families and InternVL (its <img></img> counted for the image's
    placeholder). Idefics3 wraps every tile of an image in marker tokens that the run counts as
    prompt tokens: the plan leaves those few out (a documented estimate)."""
    from ingest.prompt_tokens import load_prompt_counter

    count = load_prompt_counter(family_adapter.ref.source)
    assert count is not None
    for prompt in ("What is the total?", "Décris la scène. 表は?", '{"json": "braces"} and {{ jinja }}'):
        run = len(family_adapter.prompt_ids(prompt, None))
        if family_adapter.family.startswith("qwen") or family_adapter.family == "internvl":
            assert count(prompt) == run, prompt
        else:
            assert 0 <= run - count(prompt) <= 4, prompt  # the global image's markers


@pytest.mark.slow
@pytest.mark.parametrize(
    "budget",
    [VisualBudget(), VisualBudget(detail="low", max_tokens_per_video=150)],
    ids=["model-default", "low+video-cap"],
)
def test_internvl_plan_equals_what_a_run_records(settings_factory, family_model_dir, tmp_path, budget):
    """InternVL's tiles (the grid chosen by aspect ratio, the thumbnail) and its <img></img>
    markers: the plan's visual and prompt tokens are what a run of the tiny InternVL spends."""
    model_dir = family_model_dir("internvl")
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "doc.pdf", pages=2)
    write_video(inputs / "clip.mp4", seconds=2)  # 2 frames at 1 fps, 320x240: 4x3 tiles + thumbnail
    spec = JobSpec(
        prompts=["What is the total?", "Describe it."],
        sampling=Sampling(max_new_tokens=4),
        ingest=IngestOptions(),
        budget=budget,
    )
    plan = plan_job([inputs], spec, load_plan_model(str(model_dir)), element_bytes=dtype_bytes("float32"))
    rt = Runtime(settings_factory(model=str(model_dir), dtype="float32"))
    job_id = run_job(rt, [inputs], spec)
    records = list(repo.iter_results(rt.db, job_id))
    summary = repo.job_summary(rt.db, job_id)
    rt.close()
    assert summary["status"] == "succeeded", summary["errors"]
    by_source = defaultdict(list)
    for r in records:
        by_source[r["source"]].append(r)
    assert {s.source for s in plan.sources} == set(by_source)
    for source in plan.sources:
        rows = by_source[source.source]
        assert source.requests == len(rows)
        assert source.visual_tokens == sum(r["visual_tokens"] for r in rows if r["prompt_index"] == 0)
        assert source.prompt_tokens == sum(r["prompt_tokens"] for r in rows)
    assert plan.total.visual_tokens == summary["visual_tokens"] == summary["tokens"]["spent"]["visual"]
    assert plan.total.prompt_tokens == summary["prompt_tokens"]
    video = next(s for s in plan.sources if s.kind == "video")
    if budget.detail == "low":
        assert video.visual_tokens <= 150  # one 224-px tile (64 tokens) per frame
        assert summary["tokens"]["saved"]["detail"] > 0
    else:
        assert video.visual_tokens == 2 * 13 * 64  # 4x3 tiles and the thumbnail per frame


def test_plan_imports_neither_torch_nor_transformers(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    pdf = write_pdf(tmp_path / "a.pdf", pages=1)
    code = (
        "import sys; from worker.cli.main import app\n"
        "try:\n    app()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "plan", str(pdf), "-p", "hi", "--model", str(tiny_model_dir), "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr
