"""The ingest-time visual-token count equals what the processor actually produces, for every family.

The count comes from ``ingest.token_rules`` (the model's JSON files, no torch); the reference is
the family's own transformers image processor on a real image of that size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from ingest.anyres import AnyResRule
from ingest.budget import PixelBounds
from ingest.token_rules import DynamicTileRule, SmartResizeRule, TileRule, load_token_rule
from tests.model_fixtures import FAMILIES


def _anyres_processor_tokens(adapter, image: Image.Image, bounds: PixelBounds | None) -> int:
    """LLaVA-OneVision: the <image> ids the whole processor writes, and the tiles it cuts. Its count
    reads the grids from its image processor (not from the call), so a budget's grids go there."""
    import copy

    processor = copy.deepcopy(adapter.processor)
    processor.image_processor.image_grid_pinpoints = adapter.pinpoints_for(bounds)
    out = processor(text=[f"{processor.image_token}\nx"], images=[image], return_tensors="pt")
    assert out["pixel_values"].shape[1] == adapter.anyres_rule.tiles(image.width, image.height, bounds)
    return int((out["input_ids"] == processor.image_token_id).sum())


def _processor_tokens(adapter, width: int, height: int, bounds: PixelBounds | None = None) -> int:
    """Tokens the family's processor makes of a `width` x `height` image, from its own outputs."""
    image = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    processor = adapter.processor.image_processor
    size = adapter._size_kwargs(bounds)
    if isinstance(adapter.token_rule, AnyResRule):
        return _anyres_processor_tokens(adapter, image, bounds)
    if isinstance(adapter.token_rule, DynamicTileRule):
        # InternVL: the whole processor (tiling on, as it sets it), the <IMG_CONTEXT> ids it writes.
        full = adapter.processor
        out = full(text=[f"{full.image_token}\nx"], images=[image], return_tensors="pt", **size)
        assert out["pixel_values"].shape[0] == adapter.tile_rule.slots(
            int(torch.tensor(adapter.tile_rule.tiles(width, height, bounds)).prod())
        )
        return int((out["input_ids"] == full.image_token_id).sum())
    if isinstance(adapter.token_rule, TileRule):
        out = processor(images=[[image]], return_tensors="pt", return_row_col_info=True, **size)
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        # What the model will see: every real tile of the batch is image_seq_len tokens.
        tiles = int((out["pixel_values"][0].flatten(1) != 0).any(dim=1).sum())
        assert tiles == (rows * cols + 1 if rows * cols else 1)
        return adapter.tokens_for_grid(torch.tensor([[1, rows, cols]]))
    grid = processor(images=[image], return_tensors="pt", **size)["image_grid_thw"]
    return int(grid.prod()) // adapter.merge_size**2


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    width=st.integers(min_value=10, max_value=2400),
    height=st.integers(min_value=10, max_value=2400),
)
def test_token_count_matches_processor(family_adapter, width, height):
    rule = family_adapter.token_rule
    if isinstance(rule, SmartResizeRule) and max(width, height) / min(width, height) > 200:
        with pytest.raises(ValueError):
            family_adapter.count_visual_tokens(width, height)
        return
    assert family_adapter.count_visual_tokens(width, height) == _processor_tokens(
        family_adapter, width, height
    )


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    width=st.integers(min_value=20, max_value=2400),
    height=st.integers(min_value=20, max_value=2400),
    tokens=st.integers(min_value=1, max_value=1200),
)
@example(width=66, height=978, tokens=63)  # scaled up past the cap (qwen3_vl, found in CI)
def test_token_count_under_a_budget_matches_processor(family_adapter, width, height, tokens):
    # A job's budget (--max-tokens-per-frame): the same bounds go to the rule and the processor.
    if max(width, height) / min(width, height) > 100:
        return
    geometry = family_adapter.token_geometry
    bounds = PixelBounds(
        min(geometry.default.min_pixels, tokens * geometry.token_pixels), tokens * geometry.token_pixels
    )
    expected = _processor_tokens(family_adapter, width, height, bounds)
    assert family_adapter.count_visual_tokens(width, height, bounds) == expected
    if expected > tokens:  # only a floor overshoots the cap: one tile, one token per side, or
        rule = family_adapter.token_rule  # a small image scaled up to min_pixels (rounded up)
        if isinstance(rule, AnyResRule):
            assert len(rule.pinpoints_for(bounds)) == 1  # only the one-tile grid is left
        elif isinstance(rule, TileRule | DynamicTileRule):
            assert tokens < rule.image_seq_len
        else:
            floor = min(rule.resized(width, height, bounds)) == rule.factor
            # smart_resize first rounds each side to the factor; an image whose ROUNDED area is
            # under min_pixels is scaled up, rounding up (66x978 -> 64x992, under 64,512: overshoots)
            f = rule.factor
            rounded_area = round(width / f) * f * round(height / f) * f
            assert floor or rounded_area < bounds.min_pixels


def test_known_counts(tiny_adapter):
    # Figures from the Qwen2-VL documentation: 448x448 -> 256 tokens, 1280x720 -> 1196.
    assert tiny_adapter.count_visual_tokens(448, 448) == 256
    assert tiny_adapter.count_visual_tokens(1280, 720) == 1196


@pytest.mark.parametrize("family", FAMILIES)
def test_rule_from_the_json_files_alone(family_model_dir, family):
    """The rule loads from the model's folder without transformers' processor: the family and its
    numbers come from config.json and the processor file."""
    rule = load_token_rule(str(family_model_dir(family)))
    assert rule.family == family
    if family.startswith("qwen3"):
        assert isinstance(rule, SmartResizeRule) and rule.factor == 32  # 16-px patches merged 2x2
    elif family == "idefics3":
        assert isinstance(rule, TileRule) and (rule.tile, rule.image_seq_len, rule.longest_edge) == (
            128,
            16,
            512,
        )
    elif family == "internvl":
        assert isinstance(rule, DynamicTileRule)
        assert (rule.tile, rule.image_seq_len, rule.min_tiles, rule.max_tiles) == (224, 64, 1, 12)
    elif family == "llava_onevision":
        assert isinstance(rule, AnyResRule)
        assert (rule.tile, rule.side, len(rule.pinpoints), rule.max_tiles) == (98, 7, 36, 9)
    else:
        assert isinstance(rule, SmartResizeRule) and rule.factor == 28


def test_real_model_files():
    """The rule read from the JSON files real checkpoints ship (values as published on the hub)."""
    from ingest.token_rules import rule_from_files

    qwen3 = rule_from_files(
        {"model_type": "qwen3_vl"},
        {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "merge_size": 2},
    )
    assert qwen3.count_visual_tokens(1024, 1024) == 1024  # 32 x 32 px per token
    granite_docling = rule_from_files(
        {
            "model_type": "idefics3",
            "scale_factor": 4,
            "vision_config": {"image_size": 512, "patch_size": 16},
        },
        {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}, "do_image_splitting": True},
    )
    assert granite_docling.image_seq_len == 64
    # A 1288-px A4 page (portrait): the long side becomes 2048 = 4 tiles, the short 1448 -> 3.
    assert granite_docling.tiles(911, 1288) == (4, 3)
    assert granite_docling.count_visual_tokens(911, 1288) == (12 + 1) * 64


@pytest.mark.parametrize("detail", ["low", "medium", "high"])
def test_a_detail_preset_never_adds_tiles(family_model_dir, detail):
    """Idefics3 upscales every image to its longest edge: a preset may lower that edge, never raise it."""
    from ingest.budget import VisualBudget, job_bounds

    rule = load_token_rule(str(family_model_dir("idefics3")))
    bounds = job_bounds(VisualBudget(detail=detail), ["x"], None, rule.token_geometry)
    for width, height in [(56, 56), (911, 1288), (1280, 720), (97, 1500)]:
        assert rule.count_visual_tokens(width, height, bounds) <= rule.count_visual_tokens(width, height)


def test_an_unreachable_hub_is_said_so_not_taken_for_a_missing_file(monkeypatch):
    """huggingface_hub 1.x raises LocalEntryNotFoundError (a subclass of EntryNotFoundError) when
    the hub cannot be reached: that is not "the model has no such file". The hub is mocked."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    import ingest.token_rules
    from ingest.token_rules import ModelFilesUnavailable, model_file

    # The quick reachability probe passes (as if online): the hub client itself then fails.
    monkeypatch.setattr(ingest.token_rules, "hub_unreachable_reason", lambda: None)
    calls = []

    def offline(repo, name, revision=None, local_files_only=False, **kwargs):
        calls.append(local_files_only)
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ModelFilesUnavailable, match="is the model hub reachable"):
        model_file("Org/model", "config.json")
    assert calls == [True, False]  # the cache, then the hub

    def missing(repo, name, revision=None, local_files_only=False, **kwargs):
        raise EntryNotFoundError("404")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    assert model_file("Org/model", "processor_config.json") is None


# InternVL3-1B-hf's files as published (config.json, preprocessor_config.json): 448-px tiles of
# 14-px patches, pixel-shuffled 2x2, at most 12 tiles (crop_to_patches is left off in the file:
# InternVLProcessor turns it on for every call).
INTERNVL3_CONFIG = {
    "model_type": "internvl",
    "downsample_ratio": 0.5,
    "image_seq_length": 256,
    "vision_config": {"image_size": [448, 448], "patch_size": [14, 14]},
}
INTERNVL3_PREPROCESSOR = {
    "size": {"height": 448, "width": 448},
    "crop_to_patches": False,
    "min_patches": 1,
    "max_patches": 12,
    "image_processor_type": "GotOcr2ImageProcessorFast",
}


def test_internvl3_files_against_its_image_processor():
    """The rule from InternVL3's published files counts the tiles transformers' own processor
    cuts (its get_number_of_image_patches, with tiling on as InternVLProcessor calls it)."""
    from transformers import GotOcr2ImageProcessor

    from ingest.token_rules import rule_from_files

    rule = rule_from_files(INTERNVL3_CONFIG, INTERNVL3_PREPROCESSOR)
    assert isinstance(rule, DynamicTileRule) and (rule.tile, rule.image_seq_len) == (448, 256)
    assert rule.token_geometry.token_pixels == 28 * 28  # as Qwen2-VL's
    processor = GotOcr2ImageProcessor(size={"height": 448, "width": 448}, max_patches=12)
    rng = np.random.default_rng(0)
    sizes = [(911, 1288), (1288, 911), (1280, 720), (448, 448), (97, 1500), (56, 56), (3000, 400)]
    sizes += [tuple(int(v) for v in rng.integers(10, 4000, 2)) for _ in range(300)]
    for width, height in sizes:
        for max_tiles in (1, 4, 12):
            tiles = processor.get_number_of_image_patches(
                height, width, {"crop_to_patches": True, "max_patches": max_tiles}
            )
            bounds = PixelBounds(1, rule.slots(max_tiles) * rule.tile_pixels)
            assert rule.count_visual_tokens(width, height, bounds) == tiles * 256, (width, height, max_tiles)
    # An A4 page (portrait): a 2x3 grid and the thumbnail.
    assert rule.tiles(911, 1288) == (3, 2) and rule.count_visual_tokens(911, 1288) == 7 * 256


@pytest.mark.parametrize(("detail", "max_tiles"), [("low", 1), ("medium", 4), ("high", 12)])
def test_internvl_detail_presets_choose_max_tiles(detail, max_tiles):
    """A preset is InternVL's max tiles: low one 448-px tile (256 tokens), medium up to four and
    the thumbnail (1,280 at most), high the model's own twelve and the thumbnail (the same
    bounds, hence the same cache entries, as no preset)."""
    from ingest.budget import VisualBudget, job_bounds
    from ingest.token_rules import rule_from_files

    rule = rule_from_files(INTERNVL3_CONFIG, INTERNVL3_PREPROCESSOR)
    bounds = job_bounds(VisualBudget(detail=detail), ["x"], None, rule.token_geometry)
    assert rule.max_tiles_for(bounds) == max_tiles
    assert (bounds is None) == (detail == "high")
    for width, height in [(56, 56), (911, 1288), (1280, 720), (97, 1500), (2480, 3508)]:
        tokens = rule.count_visual_tokens(width, height, bounds)
        assert tokens <= rule.slots(max_tiles) * 256
        assert tokens <= rule.count_visual_tokens(width, height)  # never more than the model's own
    # A per-frame cap under the preset still wins: 600 tokens is two slots, one tile.
    capped = job_bounds(
        VisualBudget(detail=detail, max_tokens_per_frame=600), ["x"], None, rule.token_geometry
    )
    assert rule.max_tiles_for(capped) == 1
