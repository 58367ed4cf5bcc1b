"""Detail presets and token caps: the count at ingest, the encode and the processor agree, and
the bounds are part of the cache key."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from ingest.budget import (
    DETAIL_TOKENS,
    PixelBounds,
    TokenGeometry,
    VisualBudget,
    auto_level,
    job_bounds,
    prompt_level,
    video_cap_bounds,
)
from ingest.spec import JobSpec

SIZES = [(1288, 911), (911, 1288), (1280, 720), (320, 240), (97, 1500), (56, 56), (3000, 2000)]
GEOMETRY = TokenGeometry(784, PixelBounds(3136, 1280 * 784))


def _processor_tokens(adapter, width: int, height: int, bounds: PixelBounds | None) -> int:
    image = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    kwargs = (
        {}
        if bounds is None
        else {"size": {"shortest_edge": bounds.min_pixels, "longest_edge": bounds.max_pixels}}
    )
    grid = adapter.processor.image_processor(images=[image], return_tensors="pt", **kwargs)["image_grid_thw"]
    return int(grid.prod()) // adapter.merge_size**2


@pytest.mark.parametrize("detail", ["low", "medium", "high"])
def test_presets_count_tokens_exactly_as_the_processor(tiny_adapter, detail):
    bounds = job_bounds(VisualBudget(detail=detail), ["x"], None, tiny_adapter.token_geometry)
    expected_max = DETAIL_TOKENS[detail] * 28 * 28
    assert (bounds or tiny_adapter.token_geometry.default).max_pixels == expected_max
    for width, height in SIZES:
        tokens = tiny_adapter.count_visual_tokens(width, height, bounds)
        assert tokens == _processor_tokens(tiny_adapter, width, height, bounds), (width, height)
        assert tokens <= DETAIL_TOKENS[detail] or min(width, height) < 56  # a 28-px floor side


def test_explicit_pixels_and_frame_cap(tiny_adapter):
    geometry = tiny_adapter.token_geometry
    budget = VisualBudget(
        detail="high", min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 500, max_tokens_per_frame=300
    )
    bounds = job_bounds(budget, ["x"], None, geometry)
    assert bounds == PixelBounds(28 * 28 * 8, 28 * 28 * 300)  # explicit beats the preset, the cap beats both
    for width, height in SIZES:
        assert tiny_adapter.count_visual_tokens(width, height, bounds) == _processor_tokens(
            tiny_adapter, width, height, bounds
        )
    # A tiny image is grown to min_pixels, as the processor does.
    assert (
        tiny_adapter.count_visual_tokens(56, 56, bounds)
        == _processor_tokens(tiny_adapter, 56, 56, bounds)
        >= 8
    )


def test_encode_and_cache_key_follow_the_bounds(tiny_adapter):
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 255, (720, 1280, 3), dtype=np.uint8))
    low = job_bounds(VisualBudget(detail="low"), ["x"], None, tiny_adapter.token_geometry)
    [full], [small] = tiny_adapter.encode([image]), tiny_adapter.encode([image], low)
    assert full.num_tokens == tiny_adapter.count_visual_tokens(1280, 720) == 1196
    assert small.num_tokens == tiny_adapter.count_visual_tokens(1280, 720, low) <= 256
    assert tiny_adapter.cache_key("h", low) != tiny_adapter.cache_key("h")
    assert tiny_adapter.fingerprint_for(low) != tiny_adapter.fingerprint
    # The model's own bounds spelled out are no budget at all: same key, same fingerprint.
    assert tiny_adapter.cache_key("h", tiny_adapter.token_geometry.default) == tiny_adapter.cache_key("h")
    assert job_bounds(VisualBudget(), ["x"], None, tiny_adapter.token_geometry) is None


@pytest.mark.parametrize(
    ("prompts", "level"),
    [
        (["What is the invoice total?"], "high"),
        (["Transcribe the text."], "high"),
        (["Read the date on the receipt"], "high"),
        (["Describe the scene."], "low"),
        (["What kind of place is this?", "Classify the category of the photo."], "low"),
        (["Describe the scene.", "What is the total amount?"], "high"),
        (["Is anyone smiling?"], "medium"),
        (["Describe the scene.", "Is anyone smiling?"], "medium"),
    ],
)
def test_auto_rule(prompts, level):
    assert auto_level(prompts) == level


def test_auto_reads_the_schema_field_names():
    schema = {"type": "object", "properties": {"invoice_total": {"type": "number"}}}
    assert auto_level(["Describe it."], schema) == "high"
    assert prompt_level("Fill in the fields.") == "high"
    spec = JobSpec(prompts=["Describe the scene."], budget=VisualBudget(detail="auto"))
    assert job_bounds(spec.budget, spec.prompts, None, GEOMETRY) == PixelBounds(3136, 256 * 784)


def test_per_video_cap_lowers_the_frames():
    # 10 frames of 300 tokens, capped at 1000: 100 tokens' worth of pixels per frame.
    assert video_cap_bounds(None, 10, 300, 1000, GEOMETRY) == PixelBounds(3136, 100 * 784)
    assert video_cap_bounds(None, 3, 300, 1000, GEOMETRY) is None  # fits: unchanged
    assert video_cap_bounds(None, 10, 300, None, GEOMETRY) is None
    # Under min_pixels' worth per frame: the minimum follows the maximum down.
    assert video_cap_bounds(None, 100, 300, 200, GEOMETRY) == PixelBounds(1568, 1568)
    assert video_cap_bounds(None, 100, 300, 50, GEOMETRY) == PixelBounds(784, 784)  # one token each at least


def test_budget_is_json_and_validated():
    spec = JobSpec(
        prompts=["x"], budget=VisualBudget(detail="low", max_tokens_per_video=5000, prune_keep=0.5)
    )
    again = JobSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert JobSpec.model_validate({"prompts": ["x"]}).budget == VisualBudget()  # older specs load
    with pytest.raises(ValueError):
        VisualBudget(min_pixels=10_000, max_pixels=1_000)
    with pytest.raises(ValueError):
        VisualBudget(detail="ultra")
    with pytest.raises(ValueError):
        VisualBudget(prune_keep=0)
