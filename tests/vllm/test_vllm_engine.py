"""vLLM fed cached visual tokens generates exactly what the transformers engine generates.

Both engines run the same tiny random Qwen2-VL (same weights, fp32 on CPU); the transformers
engine is itself proven equal to generation from pixels (tests/test_cached_equals_pixels.py),
so equal tokens here mean vLLM on cached tokens == the model on pixels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from tests.vllm.conftest import family_engines
from tests.vllm.helpers import SCHEMA, SIZES, assert_same, encode, random_image, request
from worker.engines import EngineRequest
from worker.engines.structured import validate_output
from worker.tokens.tensors import VisualTokens

# Budget: a vLLM engine start (Qwen2.5-VL), 110 s on a busy 2-core machine; to be tightened.
pytestmark = pytest.mark.budget(300, reason="a vLLM engine start on a CPU")


def test_images_of_several_sizes(vllm_engine, hf_engine, vllm_adapter):
    visuals = encode(vllm_adapter, [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)])
    assert [v.num_tokens for v in visuals] == [vllm_adapter.count_visual_tokens(w, h) for w, h in SIZES]
    requests = [request(vllm_adapter, vt, f"size-{i}") for i, vt in enumerate(visuals)]
    out = vllm_engine.generate(requests)
    assert_same(out, hf_engine.generate(requests))
    assert all(len(g.token_ids) > 0 for g in out)


def test_video_frames(vllm_engine, hf_engine, vllm_adapter, tmp_path):
    # The pipeline treats sampled frames as images: one cached entry per frame.
    from ingest.units import RenderedImage
    from ingest.video import sample_video_frames
    from tests.media import write_video

    path = write_video(tmp_path / "clip.mp4", seconds=3, size=(320, 240))
    frames = [f for f in sample_video_frames(path, fps=1.0, max_frames=4) if isinstance(f, RenderedImage)]
    assert len(frames) == 3
    visuals = encode(vllm_adapter, [f.image for f in frames])
    requests = [request(vllm_adapter, vt, f"frame-{i}") for i, vt in enumerate(visuals)]
    assert_same(vllm_engine.generate(requests), hf_engine.generate(requests))


def test_json_schema(vllm_engine, hf_engine, vllm_adapter):
    visuals = encode(vllm_adapter, [random_image(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES[:3])])
    requests = [
        request(vllm_adapter, vt, f"json-{i}", "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA)
        for i, vt in enumerate(visuals)
    ]
    out = vllm_engine.generate(requests)
    for gen in out:
        assert gen.finish_reason == "stop", gen
        value, error = validate_output(gen.text, SCHEMA)
        assert error is None, (gen.text, error)
        assert set(value) == {"label", "count", "ok"}
    # Same grammar engine (llguidance, compact JSON) on both sides: the same tokens.
    assert_same(out, hf_engine.generate(requests))


def test_batch_mixing_jobs(vllm_engine, hf_engine, vllm_adapter):
    """One packed batch from two jobs: different prompts, image sizes, lengths and schemas."""
    job_a = encode(vllm_adapter, [random_image(640, 480, 20), random_image(200, 900, 21)])
    job_b = encode(vllm_adapter, [random_image(300, 300, 22), random_image(1000, 200, 23)])
    requests = [
        request(vllm_adapter, job_a[0], "a0", "What is the total?", max_new_tokens=8),
        request(vllm_adapter, job_a[0], "a0", "Who is the vendor?", max_new_tokens=8),
        request(vllm_adapter, job_a[1], "a1", "What is the total?", max_new_tokens=8),
        request(vllm_adapter, job_b[0], "b0", "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA),
        request(vllm_adapter, job_b[1], "b1", "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA),
    ]
    out = vllm_engine.generate(requests)
    # The transformers engine pads a batch to one max_new_tokens; compare per job to keep it honest.
    assert_same(out[:3], hf_engine.generate(requests[:3]))
    assert_same(out[3:], hf_engine.generate(requests[3:]))


def test_prompts_over_one_image_hit_the_prefix_cache(vllm_engine, hf_engine, vllm_adapter):
    (vt,) = encode(vllm_adapter, [random_image(448, 448, seed=30)])  # 256 visual tokens
    prompts = ["What is the total?", "Who is the vendor?", "What is the date?", "Is it paid?"]
    before, counted = vllm_engine.prefix_cache_stats(), vllm_engine.prefix_cache.cached_tokens
    first = vllm_engine.generate([request(vllm_adapter, vt, "page-30", prompts[0])])
    rest = vllm_engine.generate([request(vllm_adapter, vt, "page-30", p) for p in prompts[1:]])

    # Per request (exact): the image's KV blocks were computed once; every later prompt over it
    # reads them from the cache.
    assert first[0].cached_tokens == 0
    assert all(g.cached_tokens >= vt.num_tokens // 2 for g in rest), [g.cached_tokens for g in rest]
    # A hit changes nothing in what is generated.
    hf = hf_engine.generate([request(vllm_adapter, vt, "page-30", p) for p in prompts])
    assert_same(first + rest, hf)

    # The uuid (our cache key) is what names the image: the same tensors under another key miss.
    other = vllm_engine.generate([request(vllm_adapter, vt, "another-key", prompts[1])])
    assert other[0].cached_tokens == 0

    hits = sum(g.cached_tokens for g in rest)
    assert vllm_engine.prefix_cache.cached_tokens - counted == hits
    # vLLM's Prometheus counters agree. They arrive with the scheduler's stats, which can trail
    # the outputs by a step, so they are read after a later batch (`other`) has run.
    after = vllm_engine.prefix_cache_stats()
    assert after["hits"] - before["hits"] >= hits
    assert after["queries"] > before["queries"]


def _one_placeholder_short(adapter, vt: VisualTokens) -> list[int]:
    ids = adapter.prompt_ids("x", vt)
    at = ids.index(adapter.image_token_id)
    return ids[:at] + ids[at + 1 :]


def _bad_variants(adapter, vt: VisualTokens) -> dict[str, EngineRequest]:
    good = request(adapter, vt, "bad-base")
    wide = torch.zeros(vt.num_tokens, adapter.hidden_size + 1)
    wrong_hidden = VisualTokens(embeds=wide, grid_thw=vt.grid_thw)
    nan = vt.embeds.clone()
    nan[0, 0] = float("nan")
    return {
        "hidden size": dataclasses.replace(good, visual=wrong_hidden),
        "dtype": dataclasses.replace(good, visual=VisualTokens(vt.embeds.to(torch.float16), vt.grid_thw)),
        "nan": dataclasses.replace(good, visual=VisualTokens(nan, vt.grid_thw)),
        "grid": dataclasses.replace(good, visual=VisualTokens(vt.embeds, vt.grid_thw * 2)),
        "1-D grid": dataclasses.replace(good, visual=VisualTokens(vt.embeds, vt.grid_thw.view(3))),
        "placeholders": dataclasses.replace(good, prompt_ids=_one_placeholder_short(adapter, vt)),
        "too long": dataclasses.replace(good, prompt_ids=good.prompt_ids + [0] * 5000),
    }


def test_bad_entries_fail_alone_and_the_engine_lives(vllm_engine, hf_engine, vllm_adapter):
    vt_a, vt_b = encode(vllm_adapter, [random_image(280, 280, 40), random_image(560, 280, 41)])
    bad = _bad_variants(vllm_adapter, vt_a)
    good = [request(vllm_adapter, vt_a, "good-a"), request(vllm_adapter, vt_b, "good-b")]
    out = vllm_engine.generate([good[0], *bad.values(), good[1]])
    assert len(out) == len(bad) + 2
    for name, gen in zip(bad, out[1:-1], strict=True):
        assert gen.error is not None and gen.error.startswith("rejected before the engine"), name
        assert gen.token_ids == [], name
    assert_same([out[0], out[-1]], hf_engine.generate(good))
    # And the next batch still runs.
    assert_same(vllm_engine.generate(good[:1]), hf_engine.generate(good[:1]))


# --- Qwen2.5-VL, the other supported family: its own LLM, built last --------------------------
# Last on purpose: building a second LLM in the process re-registers vLLM's process-wide
# Prometheus metrics, so the session engine's get_metrics() must be read before this runs.


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory) -> Iterator[tuple]:
    yield from family_engines("qwen2_5_vl", tmp_path_factory)


def test_qwen25_images_and_schema(qwen25):
    adapter, vllm_engine, hf_engine = qwen25
    visuals = encode(adapter, [random_image(w, h, seed=50 + i) for i, (w, h) in enumerate(SIZES)])
    plain = [request(adapter, vt, f"q25-{i}") for i, vt in enumerate(visuals)]
    assert_same(vllm_engine.generate(plain), hf_engine.generate(plain))
    structured = [
        request(adapter, vt, f"q25-{i}", "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA)
        for i, vt in enumerate(visuals[:2])
    ]
    assert_same(vllm_engine.generate(structured), hf_engine.generate(structured))
