"""Qwen3-VL (dense and MoE) under vLLM, fed cached tokens WITH their deepstack features.

vLLM 0.32 applies deepstack only when its Qwen3-VL has the tower module (built when a prompt may
carry an image), and then takes `image_embeds` as the main embeddings and the deepstack maps
concatenated along the hidden axis; the adapter asks for both (worker.models.qwen3_vl). Equal
tokens to the transformers engine, itself equal to the pixel path with deepstack
(tests/test_cached_equals_pixels.py), mean vLLM on cached tokens == the model on pixels.

Run after the Qwen2-VL session engine's metrics test (files run in name order): building another
LLM in the process re-registers vLLM's process-wide Prometheus metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.conftest import family_engines
from tests.vllm.helpers import SCHEMA, SIZES, assert_same, encode, random_image, request, window_request
from worker.engines.structured import validate_output

# Budget: two vLLM engine starts (Qwen3-VL, Qwen3-VL-MoE), 270 s on a busy 2-core machine; to be tightened.
pytestmark = pytest.mark.budget(600, reason="two vLLM engine starts on a CPU")


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def qwen3(request, tmp_path_factory) -> Iterator[tuple]:
    yield from family_engines(request.param, tmp_path_factory)


def test_images_with_deepstack_equal_the_transformers_engine(qwen3):
    adapter, engine, hf = qwen3
    visuals = encode(adapter, [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)])
    assert all(v.extras["deepstack"].shape[1] == v.num_tokens for v in visuals)
    requests = [request(adapter, vt, f"q3-size-{i}") for i, vt in enumerate(visuals)]
    out = engine.generate(requests)
    assert_same(out, hf.generate(requests))
    assert all(len(g.token_ids) > 0 for g in out)


def test_json_schema_and_prefix_cache(qwen3):
    adapter, engine, hf = qwen3
    visuals = encode(adapter, [random_image(448, 448, seed=50), random_image(700, 300, seed=51)])
    requests = [
        request(adapter, vt, f"q3-json-{i}", "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA)
        for i, vt in enumerate(visuals)
    ]
    out = engine.generate(requests)
    for gen in out:
        assert validate_output(gen.text, SCHEMA)[1] is None, gen.text
    assert_same(out, hf.generate(requests))
    # Several prompts over one image: the image's KV blocks are served from the prefix cache.
    prompts = ["Describe this image.", "What is in this image?", "Name one colour."]
    first = engine.generate([request(adapter, visuals[0], "q3-page", prompts[0])])
    rest = engine.generate([request(adapter, visuals[0], "q3-page", p) for p in prompts[1:]])
    assert all((g.cached_tokens or 0) >= visuals[0].num_tokens // 2 for g in rest), [
        g.cached_tokens for g in rest
    ]
    assert_same(first + rest, hf.generate([request(adapter, visuals[0], "q3-page", p) for p in prompts]))


def test_bad_deepstack_fails_alone(qwen3):
    import dataclasses

    import torch

    from worker.tokens.tensors import VisualTokens

    adapter, engine, hf = qwen3
    good_vt, other_vt = encode(adapter, [random_image(280, 280, 60), random_image(560, 280, 61)])
    deep = good_vt.extras["deepstack"]
    good = request(adapter, good_vt, "q3-good")
    bad = {
        "missing": VisualTokens(good_vt.embeds, good_vt.grid_thw),
        "short": VisualTokens(good_vt.embeds, good_vt.grid_thw, {"deepstack": deep[:, :-1]}),
        "layers": VisualTokens(good_vt.embeds, good_vt.grid_thw, {"deepstack": deep[:1]}),
        "nan": VisualTokens(
            good_vt.embeds, good_vt.grid_thw, {"deepstack": torch.full_like(deep, float("nan"))}
        ),
    }
    batch = [
        good,
        *(dataclasses.replace(good, visual=v) for v in bad.values()),
        request(adapter, other_vt, "q3-o"),
    ]
    out = engine.generate(batch)
    for name, gen in zip(bad, out[1:-1], strict=True):
        assert gen.error is not None and gen.error.startswith("rejected before the engine"), name
    assert_same([out[0], out[-1]], hf.generate([batch[0], batch[-1]]))


def test_a_window_with_deepstack_equals_the_transformers_engine(qwen3):
    """Several images in one prompt (issue 34's windows): each image's embeddings and deepstack
    maps in order, one grid row and one cache key each; the LLM takes a window (its image limit
    is a count: worker.models.qwen3_vl.VLLM_MAX_IMAGES)."""
    adapter, engine, hf = qwen3
    visuals = encode(adapter, [random_image(w, h, seed=80 + i) for i, (w, h) in enumerate(SIZES[:3])])
    keys = [f"q3-win-{i}" for i in range(3)]
    requests = [window_request(adapter, visuals, keys), request(adapter, visuals[1], keys[1])]
    assert_same(engine.generate(requests), hf.generate(requests))
