"""Windows and follow-up turns (issue 34) on the in-process vLLM engine: several cached images in
one prompt (pages of three sizes and a video frame), each with its own placeholder and cache key,
generate token for token what the transformers engine generates from the same cached tokens
(itself equal to the model on the pixels with the same images in one prompt:
tests/test_several_images.py), beside a single page in the same batch and under a JSON schema;
a follow-up turn reads its first turn's prompt from vLLM's prefix cache. The session's Qwen2-VL
engine (tests/vllm/conftest.py); Qwen3-VL and InternVL windows are in their own modules.
"""

from __future__ import annotations

from tests.vllm.helpers import (
    SCHEMA,
    SIZES,
    assert_same,
    encode,
    random_image,
    request,
    video_frame,
    window_request,
)
from worker.engines.structured import validate_output


def test_a_window_of_mixed_sizes_and_a_frame_equals_the_transformers_engine(
    vllm_engine, hf_engine, vllm_adapter, tmp_path
):
    a = vllm_adapter
    images = [random_image(w, h, seed=200 + i) for i, (w, h) in enumerate(SIZES[:3])]
    visuals = encode(a, [*images, video_frame(tmp_path)])
    assert len({v.num_tokens for v in visuals}) >= 3
    keys = [f"win-{i}" for i in range(len(visuals))]
    requests = [
        window_request(a, visuals, keys),  # three pages and a frame
        window_request(a, visuals[1:3], keys[1:3]),  # an overlapping window
        request(a, visuals[0], keys[0]),  # a single page in the same batch
        window_request(
            a, visuals[:2], keys[:2], "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA
        ),
    ]
    out = vllm_engine.generate(requests)
    assert all(len(g.token_ids) > 0 for g in out)
    assert validate_output(out[-1].text, SCHEMA)[1] is None, out[-1].text
    assert_same(out, hf_engine.generate(requests))


def test_a_follow_up_turn_reads_its_first_turns_prompt_from_the_prefix_cache(
    vllm_engine, hf_engine, vllm_adapter
):
    a = vllm_adapter
    visuals = encode(a, [random_image(448, 448, seed=210), random_image(700, 300, seed=211)])
    keys = ["turn-0", "turn-1"]
    first = window_request(a, visuals, keys, "What is the total?")
    (answer,) = vllm_engine.generate([first])
    follow_up = window_request(
        a, visuals, keys, "And the date?", history=[("What is the total?", answer.text)]
    )
    assert follow_up.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids  # turn 1's prefix
    (second,) = vllm_engine.generate([follow_up])
    # Every full KV block of the first turn's prompt came from the cache (vLLM caches whole
    # blocks): the images' tokens, under their keys, and the question.
    block = vllm_engine.llm.llm_engine.vllm_config.cache_config.block_size
    assert answer.cached_tokens == 0
    assert second.cached_tokens >= len(first.prompt_ids) // block * block > 0, (second.cached_tokens, block)
    assert second.cached_tokens <= len(follow_up.prompt_ids)
    assert_same([answer, second], hf_engine.generate([first, follow_up]))
