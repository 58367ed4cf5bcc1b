"""One prompt over several images (a window of pages or frames, issue 34), built from cached
entries: the prompt equals the one the model's own processor makes from the same images, and
generation from the cached tokens equals generation from the pixels, token for token, on the
transformers engine, in a batch that mixes a window with a single page: for every family
(LLaVA-OneVision's window from each image's window view, the one square view its processor
shows an image of a several-image prompt on)"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.test_cached_equals_pixels import _random_image, _through_cache, window_through_cache
from worker.engines import EngineRequest, make_engine
from worker.engines.base import RequestRejected
from worker.tokens.tensors import VisualTokens

pytestmark = pytest.mark.budget(
    200, reason="7 families x (3 images in one prompt + 1), from pixels and from cache"
)

PROMPT = "What do these pages say?"
NEW_TOKENS = 12
# Three pages of different sizes (a window mixes them), the last a thumbnail.
SIZES = [(448, 448), (700, 300), (56, 56)]


def _processor_inputs(adapter, images: list[Image.Image]) -> dict:
    processor = adapter.processor
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": PROMPT}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor(text=[text], images=[images], return_tensors="pt")  # one prompt of these images


def _from_pixels(adapter, images: list[Image.Image]) -> list[int]:
    inputs = _processor_inputs(adapter, images)
    with torch.inference_mode():
        out = adapter.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    # The engine stops at end-of-sequence; generate() pads after it. Compare what was generated.
    return ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]


@pytest.mark.slow
def test_a_window_from_cached_entries_equals_the_processor_with_the_same_images(family_adapter):
    adapter = family_adapter
    images = [_random_image(w, h, seed=20 + i) for i, (w, h) in enumerate(SIZES)]
    visuals = window_through_cache(adapter, images)
    single_image = _through_cache(adapter, [images[1]])[0]
    window_ids = adapter.prompt_ids(PROMPT, visuals)
    assert window_ids == _processor_inputs(adapter, images)["input_ids"][0].tolist()
    assert window_ids.count(adapter.image_token_id) == sum(v.num_tokens for v in visuals)
    if adapter.vllm_unsupported is None:  # vLLM's inputs: one placeholder and one key per image
        vllm = adapter.vllm_prompt(window_ids, visuals, ["a", "b", "c"])
        assert vllm["prompt_token_ids"].count(adapter.image_token_id) == len(visuals)
        assert vllm["multi_modal_uuids"] == {"image": ["a", "b", "c"]}
        if len({v.num_tokens for v in visuals}) > 1:  # (a window view's are all one size)
            with pytest.raises(ValueError, match="placeholders in runs of|does not hold image"):  # reordered
                adapter.vllm_prompt(window_ids, visuals[1:] + visuals[:1], ["b", "c", "a"])

    window = EngineRequest(window_ids, tuple(visuals), "window", max_new_tokens=NEW_TOKENS)
    single = EngineRequest(
        adapter.prompt_ids(PROMPT, single_image), single_image, "page", max_new_tokens=NEW_TOKENS
    )
    assert (
        window.visual_tokens == sum(v.num_tokens for v in visuals)
        and single.visual_tokens == single_image.num_tokens
    )
    # One batch: a row of three images beside a row of one (images placed row by row, in order).
    got_window, got_single = make_engine("transformers", adapter).generate([window, single])
    eos = set(adapter.eos_token_ids)
    assert got_window.token_ids == _until_eos(_from_pixels(adapter, images), eos)
    assert got_single.token_ids == _until_eos(_from_pixels(adapter, [images[1]]), eos)


@pytest.mark.slow
def test_the_order_of_a_windows_images_is_the_prompts(family_model_dir):
    """Two pages swapped are another prompt (another answer from pixels), and the cached path
    follows the order it is given."""
    from worker.models import ModelRef, load_adapter

    adapter = load_adapter(ModelRef(str(family_model_dir("qwen2_vl"))))
    images = [_random_image(w, h, seed=40 + i) for i, (w, h) in enumerate(SIZES[:2])]
    visuals = _through_cache(adapter, images)
    engine = make_engine("transformers", adapter)
    eos = set(adapter.eos_token_ids)
    for order in ([0, 1], [1, 0]):
        chosen = tuple(visuals[i] for i in order)
        request = EngineRequest(adapter.prompt_ids(PROMPT, chosen), chosen, "w", max_new_tokens=NEW_TOKENS)
        (got,) = engine.generate([request])
        assert got.token_ids == _until_eos(_from_pixels(adapter, [images[i] for i in order]), eos)


def test_a_request_names_each_of_its_images(tiny_adapter):
    visual = VisualTokens(torch.zeros(4, 8), torch.tensor([[1, 4, 4]]))
    request = EngineRequest([1, 2], (visual, visual), "w", max_new_tokens=4)
    assert request.images == (visual, visual) and request.visual_tokens == 8
    assert EngineRequest([1], visual, "p", max_new_tokens=4).images == (visual,)
    # A window's key is its images' keys joined (worker.stages.generate.requests), one per image.
    assert EngineRequest([1, 2], (visual, visual), "k1+k2", max_new_tokens=4).image_keys == ("k1", "k2")
    with pytest.raises(RequestRejected, match="does not name 2 image"):
        _ = request.image_keys
