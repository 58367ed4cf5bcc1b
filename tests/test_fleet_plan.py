"""`visbatch plan`'s fleet figures: GPUs for a deadline, hot and cold cache bytes, S3 requests and
cost; the arithmetic by hand, the CLI's output, and the cache bytes against what a run stores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ingest.spec import JobSpec, Sampling
from tests.media import write_pdf
from worker.cli.main import app
from worker.planning.fleet_sizing import (
    ASSUMED_MFU,
    H100_BF16_DENSE_FLOPS,
    S3Prices,
    assumed_pages_per_second,
    fleet_figures,
    gpus_for,
    model_shape,
    parse_duration,
)
from worker.planning.planner import dtype_bytes, load_plan_model, plan_job

QWEN25_VL_7B = {
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 3584,
                      "spatial_merge_size": 2},
}  # fmt: skip


def test_model_shape_from_config() -> None:
    shape = model_shape(QWEN25_VL_7B)
    assert shape.cache_width == 3584
    # 28 x (attention 2 x 3584 x 3584 + 2 x 3584 x 512, MLP 3 x 3584 x 18944): ~6.5 B (the LM
    # without embeddings; the published 7.6 B counts the 152k x 3584 embeddings twice).
    assert shape.lm_params == 28 * (2 * 3584 * 3584 + 2 * 3584 * 4 * 128 + 3 * 3584 * 18944)
    assert shape.tower_params == 32 * (4 * 1280 * 1280 + 2 * 1280 * 3420)
    assert shape.patches_per_token == 4
    qwen3 = {
        **QWEN25_VL_7B,
        "vision_config": {**QWEN25_VL_7B["vision_config"], "deepstack_visual_indexes": [8, 16, 24]},
    }
    assert model_shape(qwen3).cache_width == 4 * 3584  # the three deepstack maps are cached too


def test_durations() -> None:
    assert parse_duration("24h") == 86400
    assert parse_duration("90m") == parse_duration("90min") == 5400
    assert parse_duration("2d") == 2 * 86400 and parse_duration("3600") == 3600
    for bad in ("", "soon", "-1h", "0h", "1y"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert gpus_for(3600, 3600) == 1 and gpus_for(3601, 3600) == 2 and gpus_for(0, 60) == 1


def test_fleet_arithmetic() -> None:
    shape = model_shape(QWEN25_VL_7B)
    pages, tokens = 10_000_000, 10_000_000 * 1518
    f = fleet_figures(units=pages, visual_tokens=tokens, visual_tokens_max=1518, shape=shape,
                      element_bytes=2, pages_per_gpu_s=5.0, throughput_source="test",
                      deadline_s=30 * 86400, pages_in_flight=80)  # fmt: skip
    per_page = 1518 * 3584 * 2 + 24 + 300
    assert f.cold_bytes == pages * per_page
    assert f.gpu_hours == pytest.approx(pages / 5.0 / 3600)
    assert f.gpus == math.ceil(pages / 5.0 / (30 * 86400))  # 2,000,000 s of work in 2,592,000 s: 1
    assert f.hot_bytes == math.ceil(f.gpus * 80 * per_page * 2)
    assert (f.s3_put, f.s3_get) == (2 * pages, 2 * pages)  # image + entry each
    assert f.s3_storage_usd_month == pytest.approx(pages * per_page / 1e9 * 0.023)
    assert f.s3_requests_usd == pytest.approx(2 * pages / 1000 * 0.005 + 2 * pages / 1000 * 0.0004)

    tight = fleet_figures(units=pages, visual_tokens=tokens, visual_tokens_max=1518, shape=shape,
                          element_bytes=2, pages_per_gpu_s=5.0, throughput_source="test",
                          deadline_s=86400, pages_in_flight=80)  # fmt: skip
    assert tight.gpus == 24  # 2,000,000 GPU-seconds in a day: 23.1 -> 24
    assert tight.hot_bytes == math.ceil(24 * 80 * per_page * 2)

    for policy in ("hot", "none"):
        f = fleet_figures(units=pages, visual_tokens=tokens, visual_tokens_max=1518, shape=shape,
                          element_bytes=2, pages_per_gpu_s=5.0, throughput_source="test",
                          cache_policy=policy, prices=S3Prices(usd_per_gb_month=1.0))  # fmt: skip
        assert f.cold_bytes == 0 and f.s3_storage_usd_month == 0
        assert (f.s3_put, f.s3_get) == (pages, pages)  # the page images only
        assert f.hot_bytes > 0 and f.gpus == 1


def test_an_entry_over_the_hot_cap_is_noted() -> None:
    def notes(cap: int) -> list[str]:
        return fleet_figures(units=10, visual_tokens=15_180, visual_tokens_max=1518,
                             shape=model_shape(QWEN25_VL_7B), element_bytes=2, pages_per_gpu_s=5.0,
                             throughput_source="test", hot_max_entry_bytes=cap).notes  # fmt: skip

    assert any("over VISBATCH_CACHE_HOT_MAX_ENTRY_BYTES (10.0 MB)" in n for n in notes(10_000_000))
    assert not any("HOT_MAX_ENTRY" in n for n in notes(32 * 1024**2))


def test_assumed_throughput_is_the_stated_formula() -> None:
    shape = model_shape(QWEN25_VL_7B)
    rate = assumed_pages_per_second(shape, 1674, 1518, 1)
    flops = 2 * shape.lm_params * 1674 + 2 * shape.tower_params * 1518 * 4
    assert rate == pytest.approx(H100_BF16_DENSE_FLOPS * ASSUMED_MFU / flops)
    assert 5 < rate < 15  # a 7B-class model: single-digit pages/s per H100 at 25% of peak


def _plan_args(tiny_model_dir: Path, tmp_path: Path) -> list[str]:
    pdf = write_pdf(tmp_path / "doc.pdf", pages=3)
    return [
        "plan",
        str(pdf),
        "--model",
        str(tiny_model_dir),
        "-p",
        "What is the total?",
        "--max-new-tokens",
        "8",
    ]


def test_plan_command_fleet(tiny_model_dir, tmp_path) -> None:
    args = _plan_args(tiny_model_dir, tmp_path)
    done = CliRunner().invoke(app, [*args, "--json", "--deadline", "1s", "--throughput", "1pages/s"])
    assert done.exit_code == 0, done.output
    fleet = json.loads(done.stdout)["fleet"]  # stderr: the model line
    assert fleet["pages"] == 3 and fleet["pages_per_gpu_s"] == 1.0
    assert fleet["gpus"] == 3 and fleet["throughput_source"] == "--throughput"
    assert fleet["cold_bytes"] > 0 and fleet["hot_bytes"] == math.ceil(
        3 * fleet["pages_in_flight_per_gpu"] * fleet["entry_bytes_mean"] * 2
    )

    text = CliRunner().invoke(app, [*args, "--deadline", "24h", "--cache", "none", "--s3-gb-month", "0.5"])
    assert text.exit_code == 0, text.output
    assert "fleet: 1 GPU(s) for 3 pages/frames within 24.0 h" in text.output
    assert "throughput: assumed: 25% of an H100 SXM" in text.output
    assert "token cache (none)" in text.output and "cold (S3) 0 B" in text.output
    assert "given on the command line" in text.output

    bad = CliRunner().invoke(app, [*args, "--deadline", "soon"])
    assert bad.exit_code != 0 and "--deadline soon" in bad.output


@pytest.mark.slow
def test_plan_cache_bytes_equal_what_a_run_stores(settings_factory, tiny_model_dir, tmp_path) -> None:
    """The plan's cold bytes, less the estimated headers, are the tensor bytes the run's cache
    entries hold, exactly (the tiny model in float32)."""
    from worker.drivers.embedded import run_job
    from worker.runtime import Runtime

    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "doc.pdf", pages=2)
    spec = JobSpec(prompts=["What is the total?"], sampling=Sampling(max_new_tokens=2))
    plan = plan_job(
        [inputs], spec, load_plan_model(str(tiny_model_dir)), element_bytes=dtype_bytes("float32")
    )
    assert plan.fleet is not None
    settings = settings_factory(dtype="float32")
    rt = Runtime(settings)
    run_job(rt, [inputs], spec)
    rt.close()
    entries = list((settings.resolved_home / "token-cache").glob("*/*.safetensors"))
    assert len(entries) == plan.total.units == 2
    tensor_bytes = 0
    for entry in entries:
        data = entry.read_bytes()
        tensor_bytes += len(data) - 8 - int.from_bytes(data[:8], "little")
    assert tensor_bytes == plan.fleet.cold_bytes - 300 * len(entries)
