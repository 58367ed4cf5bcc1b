"""LLaVA-OneVision, InternVL and Idefics3 through a real `vllm serve` (issue 35): the server runs
where visbatch is installed, so vLLM loads visbatch's plugin (the `vllm.general_plugins` entry
point) in its own processes, and the openai engine, told so (VISBATCH_LLM_SERVER_PLUGIN), takes
the three families. Two clients send pages of different sizes and a video frame at the same
time, the case that killed a server without the plugin ("data contains inconsistent shapes"), a
JSON-schema prompt, and a window of pages of mixed sizes as one message (Idefics3's pages each
with its tile grid); every answer equals the transformers engine's on the same cached tokens.
One server per family, one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.vllm.conftest import SERVER_OPTIONS, require_vllm
from tests.vllm.helpers import (
    SCHEMA,
    SIZES,
    assert_same,
    encode,
    encode_window,
    generate_at_once,
    random_image,
    request,
    video_frame,
    window_request,
)

pytestmark = pytest.mark.budget(450, reason="three vllm serve starts on a CPU, one per family")


@pytest.fixture(scope="module", params=["llava_onevision", "internvl", "idefics3"])
def served(request, tmp_path_factory) -> Iterator[tuple]:
    require_vllm()
    from tests.vllm.server import VLLMServer
    from worker.engines.openai_engine import vllm_serve_args
    from worker.engines.transformers_engine import TransformersEngine
    from worker.models import ModelRef, load_adapter
    from worker.models.tiny import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp(f"serve-{request.param}"), family=request.param)
    adapter = load_adapter(ModelRef(str(folder), device="cpu"))
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    server = VLLMServer(folder, vllm_serve_args(adapter), SERVER_OPTIONS, log_path)
    try:
        server.wait_ready()
        yield adapter, server, TransformersEngine(adapter)
    finally:
        server.stop()


def _client(server, adapter):
    from worker.engines.openai_engine import OpenAIEngine, OpenAIOptions

    options = OpenAIOptions(url=server.url, api_key=server.api_key, timeout_s=120.0, server_plugin=True)
    return OpenAIEngine(adapter, options)


def test_two_clients_with_pages_of_mixed_sizes_equal_the_transformers_engine(served, tmp_path):
    adapter, server, hf = served
    visuals = encode(adapter, [random_image(w, h, seed=150 + i) for i, (w, h) in enumerate(SIZES)])
    visuals += encode(adapter, [video_frame(tmp_path)])
    assert len({v.num_tokens for v in visuals}) >= 3, [v.num_tokens for v in visuals]
    keys = [f"{adapter.family}-srv-{i}" for i in range(len(visuals))]
    ours = [request(adapter, v, k) for v, k in zip(visuals[::2], keys[::2], strict=True)]
    theirs = [request(adapter, v, k) for v, k in zip(visuals[1::2], keys[1::2], strict=True)]
    theirs.append(
        request(adapter, visuals[0], keys[0], "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA)
    )
    # A window: several image parts in one message (LLaVA-OneVision's on their window view).
    window = encode_window(adapter, [random_image(w, h, seed=150 + i) for i, (w, h) in enumerate(SIZES[:3])])
    theirs.append(window_request(adapter, window, [f"{k}-window" for k in keys[:3]]))
    got = generate_at_once([_client(server, adapter), _client(server, adapter)], [ours, theirs])
    for requests, out in zip([ours, theirs], got, strict=True):
        assert all(len(g.token_ids) > 0 for g in out), [g.error for g in out]
        assert_same(out, hf.generate(requests))
    # The server lived through two sizes in one step (a dead engine core fails /health).
    assert server.process.poll() is None
    assert httpx.get(f"{server.root}/health", timeout=5).status_code == 200
