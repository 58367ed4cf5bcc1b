"""Shared by the vLLM tests: images, the cached-token round trip, requests, the equality check."""

from __future__ import annotations

import numpy as np
from PIL import Image

from worker.engines import EngineRequest, Generation
from worker.tokens.tensors import VisualTokens

NEW_TOKENS = 12
SIZES = [(448, 448), (700, 300), (1280, 720), (97, 1500), (56, 56)]


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def encode(adapter, images: list[Image.Image]) -> list[VisualTokens]:
    """The tower, then a round trip through the cache's serialized form (what generate sees)."""
    return [adapter.decode_tokens(vt.to_bytes(adapter.fingerprint)) for vt in adapter.encode(images)]


def encode_window(adapter, images: list[Image.Image]) -> list[VisualTokens]:
    """As `encode`, on the window view where the family shows the images of a several-image
    prompt on one (LLaVA-OneVision; worker.stages.generate.requests)."""
    from tests.test_cached_equals_pixels import window_through_cache

    return window_through_cache(adapter, images)


def request(adapter, vt: VisualTokens, key: str, prompt: str = "Describe this image.", **kw) -> EngineRequest:
    return EngineRequest(
        prompt_ids=adapter.prompt_ids(prompt, vt),
        visual=vt,
        cache_key=key,
        max_new_tokens=kw.pop("max_new_tokens", NEW_TOKENS),
        prompt=prompt,
        **kw,
    )


def window_request(
    adapter, visuals: list[VisualTokens], keys: list[str], prompt: str = "What do these pages say?", **kw
) -> EngineRequest:
    """One prompt over several cached images in order (a window, `--window`); `history`: the
    earlier turns of a follow-up (`--then`). The key is the images' keys joined, as the generate
    stage makes it."""
    history = tuple(kw.pop("history", ()))
    return EngineRequest(
        prompt_ids=adapter.prompt_ids(prompt, tuple(visuals), history),
        visual=tuple(visuals),
        cache_key="+".join(keys),
        max_new_tokens=kw.pop("max_new_tokens", NEW_TOKENS),
        prompt=prompt,
        history=history,
        **kw,
    )


def video_frame(tmp_path) -> Image.Image:
    """A sampled frame of a generated clip, as the pipeline hands it on."""
    from ingest.units import RenderedImage
    from ingest.video import sample_video_frames
    from tests.media import write_video

    clip = write_video(tmp_path / "clip.mp4", seconds=2, size=(320, 240))
    return next(
        f for f in sample_video_frames(clip, fps=1.0, max_frames=2) if isinstance(f, RenderedImage)
    ).image


def assert_same(vllm_out: list[Generation], hf_out: list[Generation]) -> None:
    assert [g.error for g in vllm_out] == [None] * len(vllm_out)
    assert [g.token_ids for g in vllm_out] == [g.token_ids for g in hf_out]
    assert [g.text for g in vllm_out] == [g.text for g in hf_out]
    assert [g.finish_reason for g in vllm_out] == [g.finish_reason for g in hf_out]


SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["label", "count", "ok"],
    "additionalProperties": False,
}


def answers(db, job_id: str) -> dict:
    """A job's answer rows by what they answer: source, first unit, prompt, turn and scope."""
    from storage import repository as repo

    return {
        (r["source"], r["unit"], r["prompt_index"], r["turn"], r["scope"]): r
        for r in repo.iter_results(db, job_id)
    }


def generate_at_once(clients: list, batches: list[list[EngineRequest]]) -> list[list[Generation]]:
    """Each client (an openai engine) generates its batch at the same time as the others, as
    several workers share one server; the clients are closed after."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            return list(pool.map(lambda client, batch: client.generate(batch), clients, batches))
    finally:
        for client in clients:
            client.close()
