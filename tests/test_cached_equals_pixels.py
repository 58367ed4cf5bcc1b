"""Generation from cached visual tokens gives exactly the tokens generation from pixels gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from worker.engines import EngineRequest, make_engine
from worker.tokens.tensors import VisualTokens

# Every family (seven) generates each image twice, from pixels and from the cache, on the CPU.
pytestmark = pytest.mark.budget(
    300, reason="7 families x (5 sizes + 3 frames), from pixels and from cache: 266 s at load 12"
)

PROMPT = "Describe this image."
NEW_TOKENS = 12


def _random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def _from_pixels(adapter, image: Image.Image) -> list[int]:
    processor = adapter.processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    with torch.inference_mode():
        out = adapter.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _through_cache(adapter, images: list[Image.Image]) -> list[VisualTokens]:
    # Round-trip through the serialized cache format, as the generate stage sees it.
    return [adapter.decode_tokens(vt.to_bytes(adapter.fingerprint)) for vt in adapter.encode(images)]


def window_through_cache(adapter, images: list[Image.Image]) -> list[VisualTokens]:
    """The images as a window of several shows them, round-tripped through the cache format: on
    the family's window view where it has one (worker.stages.generate.requests), else as above."""
    if not adapter.has_window_view:
        return _through_cache(adapter, images)
    fingerprint = adapter.fingerprint_for(None, window_view=True)
    assert fingerprint != adapter.fingerprint  # another cache entry than the usual view's
    return [
        adapter.decode_tokens(vt.to_bytes(fingerprint), fingerprint)
        for vt in adapter.encode_window_view(images)
    ]


def _requests(adapter, visuals: list[VisualTokens]) -> list[EngineRequest]:
    return [
        EngineRequest(
            prompt_ids=adapter.prompt_ids(PROMPT, vt),
            visual=vt,
            cache_key=str(i),
            max_new_tokens=NEW_TOKENS,
        )
        for i, vt in enumerate(visuals)
    ]


def _same_prefix(pixels: list[int], cached: list[int], eos: set[int]) -> None:
    # The engine stops at end-of-sequence; generate() pads after it. Compare what was generated.
    cut = next((i for i, t in enumerate(pixels) if t in eos), len(pixels))
    assert cached == pixels[:cut]


SIZES = [(448, 448), (700, 300), (1280, 720), (97, 1500), (56, 56)]


@pytest.mark.slow
def test_images_of_several_sizes(family_adapter):
    tiny_adapter = family_adapter
    images = [_random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    engine = make_engine("transformers", tiny_adapter)
    visuals = _through_cache(tiny_adapter, images)
    assert [v.num_tokens for v in visuals] == [tiny_adapter.count_visual_tokens(w, h) for w, h in SIZES]
    batched = engine.generate(_requests(tiny_adapter, visuals))
    eos = set(tiny_adapter.eos_token_ids)
    for image, gen in zip(images, batched, strict=True):
        _same_prefix(_from_pixels(tiny_adapter, image), gen.token_ids, eos)


@pytest.mark.slow
def test_video_frames(family_adapter, tmp_path):
    tiny_adapter = family_adapter
    from ingest.units import RenderedImage
    from ingest.video import sample_video_frames
    from tests.media import write_video

    path = write_video(tmp_path / "clip.mp4", seconds=3, size=(320, 240))
    frames = [f for f in sample_video_frames(path, fps=1.0, max_frames=4) if isinstance(f, RenderedImage)]
    assert len(frames) == 3
    engine = make_engine("transformers", tiny_adapter)
    visuals = _through_cache(tiny_adapter, [f.image for f in frames])
    eos = set(tiny_adapter.eos_token_ids)
    for frame, gen in zip(frames, engine.generate(_requests(tiny_adapter, visuals)), strict=True):
        _same_prefix(_from_pixels(tiny_adapter, frame.image), gen.token_ids, eos)


@pytest.mark.slow
def test_qwen3_deepstack_reaches_the_language_model(family_model_dir):
    """The cached deepstack features are what the pixel path adds; without them the model differs."""
    from worker.models import ModelRef, load_adapter

    adapter = load_adapter(ModelRef(str(family_model_dir("qwen3_vl"))))
    image = _random_image(448, 448, seed=7)
    visual = _through_cache(adapter, [image])[0]
    assert visual.extras["deepstack"].shape == (2, visual.num_tokens, adapter.hidden_size)

    def last_logits(visuals) -> torch.Tensor:
        prompts = [adapter.prompt_ids(PROMPT, v) for v in visuals]
        with torch.inference_mode():
            return adapter.model(**adapter.generation_inputs(prompts, visuals)).logits[:, -1]

    processor = adapter.processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with torch.inference_mode():
        pixels = adapter.model(**processor(text=[text], images=[image], return_tensors="pt")).logits[:, -1]
    assert torch.allclose(last_logits([visual]), pixels, atol=1e-4)
    zeroed = VisualTokens(
        visual.embeds, visual.grid_thw, {"deepstack": torch.zeros_like(visual.extras["deepstack"])}
    )
    assert (last_logits([zeroed]) - pixels).abs().max() > 1e-2


@pytest.mark.slow
def test_internvl_one_encode_serves_every_prompt(family_model_dir):
    """A page's tiles are encoded once and cached as one entry; every prompt over it (here in one
    batch, as the packer sends them) gets what the pixel path gives for that prompt."""
    from worker.models import ModelRef, load_adapter

    adapter = load_adapter(ModelRef(str(family_model_dir("internvl"))))
    image = _random_image(911, 1288, seed=11)  # an A4 page: 2x3 tiles and the thumbnail
    (visual,) = _through_cache(adapter, [image])
    assert visual.grid_thw.tolist() == [[1, 3, 2]] and visual.num_tokens == 7 * 64
    prompts = ["What is the total?", "Who is the vendor?", "Describe this image."]
    requests = [
        EngineRequest(adapter.prompt_ids(p, visual), visual, "page", max_new_tokens=NEW_TOKENS)
        for p in prompts
    ]
    outputs = make_engine("transformers", adapter).generate(requests)
    processor, eos = adapter.processor, set(adapter.eos_token_ids)
    # The vLLM inputs (through visbatch's vLLM plugin, worker.engines.vllm_models): ONE
    # <IMG_CONTEXT>, which vLLM's InternS1 expands to <img>, one id per token, </img>.
    collapsed = adapter.vllm_prompt(requests[0].prompt_ids, [visual], ["page"])["prompt_token_ids"]
    at = collapsed.index(adapter.image_token_id)
    wrapped = [processor.start_image_token_id, *[adapter.image_token_id] * visual.num_tokens]
    assert (
        collapsed[:at] + wrapped + [processor.end_image_token_id] + collapsed[at + 1 :]
        == requests[0].prompt_ids
    )
    for prompt, gen in zip(prompts, outputs, strict=True):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == adapter.prompt_ids(prompt, visual)
        with torch.inference_mode():
            out = adapter.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        _same_prefix(out[0, inputs["input_ids"].shape[1] :].tolist(), gen.token_ids, eos)
