"""LLaVA-OneVision (issue 23): the AnyRes rule against transformers' own count, presets as grids,
what the cache holds, and (slow: the tiny model) structured output, several prompts over one
image, and plan == spent.

The family-parametrized tests cover the rest for it as for every family: cached == pixels
(tests/test_cached_equals_pixels.py), rule == processor on real images with and without a budget
(tests/test_token_rule.py), pruning and merging, the planner's prompt count, and the vLLM refusal
(tests/vllm/test_engine_choice.py).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from PIL import Image

from ingest.anyres import DEFAULT_PINPOINTS, AnyResRule
from ingest.budget import PixelBounds, VisualBudget, job_bounds
from ingest.token_rules import rule_from_files

# Budget: the tiny model's encode, generation from pixels and from the cache, and three embedded
# runs (73-84 s on a busy 2-core machine, load 12, 2026-12-02).
pytestmark = pytest.mark.budget(
    150, reason="three embedded runs and pixel-path generations of the tiny model"
)

# llava-hf/llava-onevision-qwen2-0.5b-ov-hf's files as published (config.json, preprocessor_config.json,
# processor_config.json): 384-px tiles of 14-px patches (27 x 27 = 729 tokens), every grid up to 6 x 6.
PINPOINTS = [list(p) for p in DEFAULT_PINPOINTS]
OV_CONFIG = {
    "model_type": "llava_onevision",
    "image_grid_pinpoints": PINPOINTS,
    "vision_aspect_ratio": "anyres_max_9",
    "vision_feature_select_strategy": "full",
    "vision_feature_layer": -1,
    "vision_config": {"image_size": 384, "patch_size": 14, "model_type": "siglip_vision_model"},
}
OV_PREPROCESSOR = {
    "image_processor_type": "LlavaOnevisionImageProcessor",
    "size": {"height": 384, "width": 384},
    "image_grid_pinpoints": PINPOINTS,
    "do_pad": True,
}
PAGES = [(911, 1288), (1288, 911), (1280, 720), (320, 240), (448, 448), (97, 1500), (56, 56), (4000, 300)]


def _real_rule() -> AnyResRule:
    rule = rule_from_files(OV_CONFIG, OV_PREPROCESSOR)
    assert isinstance(rule, AnyResRule)
    return rule


@pytest.fixture(scope="module")
def real_processor():
    """transformers' LlavaOnevisionProcessor with the released numbers (no weights needed: its
    token count is arithmetic on image sizes)."""
    from transformers import (
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    from worker.models.tiny_llava_onevision import build_tokenizer

    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(
            size={"height": 384, "width": 384}, image_grid_pinpoints=PINPOINTS
        ),
        tokenizer=build_tokenizer(),
        video_processor=LlavaOnevisionVideoProcessor(),
        num_image_tokens=729,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
    )


def test_rule_equals_transformers_count_for_the_released_model(real_processor):
    """Per image size and per preset: the processor's own token count (unpadding, anyres_max_9,
    newlines, base view) and the model's own tile count (image_size_to_num_patches)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    rule = _real_rule()
    rng = np.random.default_rng(0)
    sizes = PAGES + [tuple(int(v) for v in rng.integers(10, 4000, 2)) for _ in range(250)]
    sizes += [
        (int(w), int(w * r))
        for w, r in zip(rng.integers(20, 3000, 30), rng.uniform(0.02, 50, 30), strict=True)
    ]
    for detail in (None, "low", "medium"):
        bounds = job_bounds(VisualBudget(detail=detail), ["x"], None, rule.token_geometry)
        pins = [list(p) for p in rule.pinpoints_for(bounds)]
        real_processor.image_processor.image_grid_pinpoints = pins
        for width, height in sizes:
            count = real_processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
            assert rule.count_visual_tokens(width, height, bounds) == count["num_image_tokens"][0], (
                width,
                height,
            )
            assert rule.tiles(width, height, bounds) == image_size_to_num_patches((height, width), pins, 384)
    # An A4 page at 1288 px (portrait): a 4 x 3 grid, unpadded to 108 x 77, interpolated to 95 x 68.
    assert rule.feature_map(911, 1288) == (95, 68)
    assert rule.count_visual_tokens(911, 1288) == 729 + 95 * 69 == 7284


def test_detail_presets_choose_grids():
    """low: one tile (and the base view); medium: grids of up to four tiles; high: the model's own
    (the same cache keys as no preset). Never more tokens than the model's own grids give."""
    rule = _real_rule()
    geometry = rule.token_geometry
    bounds = {d: job_bounds(VisualBudget(detail=d), ["x"], None, geometry) for d in ("low", "medium", "high")}
    assert rule.pinpoints_for(bounds["low"]) == ((384, 384),)
    tiles = {(h // 384) * (w // 384) for h, w in rule.pinpoints_for(bounds["medium"])}
    assert max(tiles) == 4 and len(rule.pinpoints_for(bounds["medium"])) == 8  # 1x1..1x4, 2x1, 2x2, 3x1, 4x1
    assert bounds["high"] is None
    for width, height in PAGES:
        low, medium = (rule.count_visual_tokens(width, height, bounds[d]) for d in ("low", "medium"))
        assert low <= medium <= rule.count_visual_tokens(width, height)
    # The page counts docs/engines.md gives.
    assert [rule.count_visual_tokens(911, 1288, bounds[d]) for d in ("low", "medium", "high")] == [
        1269,
        2835,
        7284,
    ]


@pytest.mark.parametrize("cap", [1000, 1500, 2000, 3000, 5000, 8000])
def test_a_token_cap_holds_unless_only_one_tile_is_left(cap):
    """--max-tokens-per-frame N: the grids allowed never make more than N tokens, whatever the
    image; one tile and the base view is the floor (1,485 at most on the released model)."""
    rule = _real_rule()
    bounds = PixelBounds(rule.tile_pixels, cap * rule.token_pixels)
    rng = np.random.default_rng(cap)
    for width, height in PAGES + [tuple(int(v) for v in rng.integers(10, 4000, 2)) for _ in range(200)]:
        tokens = rule.count_visual_tokens(width, height, bounds)
        assert tokens <= cap or len(rule.pinpoints_for(bounds)) == 1, (width, height, tokens)


def test_files_it_cannot_count_are_refused():
    from ingest.token_rules import UnsupportedModel

    for change in ({"vision_feature_select_strategy": "default"}, {"vision_aspect_ratio": "pad"}):
        with pytest.raises(UnsupportedModel):
            rule_from_files({**OV_CONFIG, **change}, OV_PREPROCESSOR)


# --- the tiny model (slow) -------------------------------------------------------------------

PROMPT = "Describe this image."


@pytest.fixture(scope="session")
def ov(family_model_dir):
    from worker.models import ModelRef, load_adapter

    adapter = load_adapter(ModelRef(str(family_model_dir("llava_onevision")), dtype="float32"))
    assert adapter.family == "llava_onevision"
    return adapter


def _image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def _cached(adapter, images, bounds=None):
    """Encoded, then read back through the cache's serialized form (what generate sees)."""
    fingerprint = adapter.fingerprint_for(bounds)
    return [
        adapter.decode_tokens(vt.to_bytes(fingerprint), fingerprint) for vt in adapter.encode(images, bounds)
    ]


@pytest.mark.slow
def test_the_cache_holds_what_goes_in_at_the_image_positions(ov):
    """Base view first, then each map row and its image_newline; the prompt is the processor's
    own; the layout's rows are what merging may join (a newline never joins anything)."""
    import torch

    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(PAGES[:5])]
    visuals = _cached(ov, images)
    newline = ov.model.model.image_newline.detach()
    side = ov.anyres_rule.side
    text = ov.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    for image, vt in zip(images, visuals, strict=True):
        _, rows, cols = (int(x) for x in vt.grid_thw.view(-1))
        assert (rows, cols) == ov.anyres_rule.feature_map(image.width, image.height)
        ends = [side * side + r * (cols + 1) + cols for r in range(rows)]  # each row's newline slot
        assert torch.equal(vt.embeds[ends], newline.expand(rows, -1))
        assert not any(torch.equal(vt.embeds[i], newline) for i in range(side * side))
        rows_of = ov.token_rows(vt)
        assert sum(rows_of) == vt.num_tokens and rows_of[side:][1::2] == [1] * rows
        pixels = ov.processor(text=[text], images=[image], return_tensors="pt")
        assert ov.prompt_ids(PROMPT, vt) == pixels["input_ids"][0].tolist()
    for bad in ([[2, 3, 4]], [[1, 0, 4]], [[1, 3, 0]]):
        with pytest.raises(ValueError):
            ov.tokens_for_grid(torch.tensor(bad))
    # vLLM's form (through visbatch's plugin): one placeholder, the (1, tokens, width) tensor.
    prompt = ov.vllm_prompt(ov.prompt_ids(PROMPT, visuals[0]), visuals[:1], ["k"])
    assert prompt["prompt_token_ids"].count(ov.image_token_id) == 1
    assert prompt["multi_modal_data"]["image"].shape == (1, visuals[0].num_tokens, ov.hidden_size)


@pytest.mark.slow
def test_a_preset_encodes_the_grids_it_counts(ov):
    """Under --detail low the encode cuts one tile and the count is the rule's; the entry is
    checked against the budget's fingerprint (another cache key than the model's own)."""
    bounds = job_bounds(VisualBudget(detail="low"), ["x"], None, ov.token_geometry)
    assert bounds is not None and ov.fingerprint_for(bounds) != ov.fingerprint
    sizes = PAGES[:5]
    visuals = _cached(ov, [_image(w, h, i) for i, (w, h) in enumerate(sizes)], bounds)
    for vt, (w, h) in zip(visuals, sizes, strict=True):
        assert vt.num_tokens == ov.count_visual_tokens(w, h, bounds) <= ov.count_visual_tokens(w, h)
        assert ov.anyres_rule.tiles(w, h, bounds) == 2  # one tile and the base view


@pytest.mark.slow
def test_structured_output_and_several_prompts_over_one_image(ov):
    """Constrained to a schema the random model still writes valid JSON; three prompts over one
    cached image in one batch give what each gives from pixels (the image encoded once)."""
    import torch

    from worker.engines import EngineRequest, make_engine
    from worker.engines.structured import validate_output

    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["invoice", "receipt", "other"]}, "has_table": {"type": "boolean"}},
        "required": ["kind", "has_table"],
        "additionalProperties": False,
    }
    engine = make_engine("transformers", ov)
    image = _image(300, 200, 2)
    visuals = _cached(ov, [_image(448, 448, 1), image])
    constrained = engine.generate(
        [
            EngineRequest(ov.prompt_ids("Classify.", vt), vt, str(i), max_new_tokens=48, json_schema=schema)
            for i, vt in enumerate(visuals)
        ]
    )
    for gen in constrained:
        assert validate_output(gen.text, schema)[1] is None, gen.text
        assert gen.finish_reason == "stop"
    prompts = ["Describe this image.", "What is the total?", "Name one colour."]
    batch = engine.generate(
        [EngineRequest(ov.prompt_ids(p, visuals[1]), visuals[1], "p", max_new_tokens=8) for p in prompts]
    )
    eos = set(ov.eos_token_ids)
    for prompt, gen in zip(prompts, batch, strict=True):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = ov.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = ov.processor(text=[text], images=[image], return_tensors="pt")
        with torch.inference_mode():
            out = ov.model.generate(**inputs, max_new_tokens=8, do_sample=False)[
                0, inputs["input_ids"].shape[1] :
            ]
        cut = next((i for i, t in enumerate(out.tolist()) if t in eos), len(out))
        assert gen.token_ids == out.tolist()[:cut], prompt


@pytest.mark.slow
@pytest.mark.parametrize(
    "budget",
    [VisualBudget(), VisualBudget(detail="low"), VisualBudget(max_tokens_per_video=300)],
    ids=["model-default", "low", "video-cap"],
)
def test_plan_equals_what_a_run_records(settings_factory, family_model_dir, tmp_path, budget):
    """`visbatch plan` on a LLaVA-OneVision model: per source, the visual and prompt tokens and the
    requests a real embedded run records (a PDF and a video; frames are encoded as images)."""
    from ingest.spec import IngestOptions, JobSpec, Sampling
    from storage import repository as repo
    from tests.media import write_pdf, write_video
    from worker.drivers.embedded import run_job
    from worker.planning.planner import dtype_bytes, load_plan_model, plan_job
    from worker.runtime import Runtime

    model = family_model_dir("llava_onevision")
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "doc.pdf", pages=2)
    write_video(inputs / "clip.mp4", seconds=2)
    spec = JobSpec(
        prompts=["What is the total?", "Describe it."],
        sampling=Sampling(max_new_tokens=4),
        ingest=IngestOptions(),
        budget=budget,
    )
    plan = plan_job([inputs], spec, load_plan_model(str(model)), element_bytes=dtype_bytes("float32"))
    assert plan.prompt_tokens_estimated is False
    rt = Runtime(settings_factory(model=str(model), dtype="float32"))
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
    if budget != VisualBudget():
        assert summary["tokens"]["saved"]["detail"] > 0
    if budget.max_tokens_per_video:  # two 320x240 frames of 499 tokens: one tile each (89) fits 300
        video = next(s for s in plan.sources if s.kind == "video")
        assert video.visual_tokens <= 300 < 2 * 499


@pytest.mark.slow
def test_the_tower_alone_encodes_what_the_whole_model_does(ov):
    """Beside another engine (vision_only) the adapter holds the tower, the projector and the
    newline alone, and encodes the same tokens; the language model is not kept."""
    import torch

    from worker.models import ModelRef, load_adapter

    alone = load_adapter(ModelRef(ov.ref.source, dtype="float32"))
    alone.vision_only = True
    images = [_image(w, h, i) for i, (w, h) in enumerate(PAGES[:3])]
    for a, b in zip(alone.encode(images), ov.encode(images), strict=True):
        assert torch.equal(a.grid_thw, b.grid_thw) and torch.equal(a.embeds, b.embeds)
    assert "model" not in alone.__dict__
