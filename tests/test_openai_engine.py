"""The openai engine's parts that need no vLLM: settings, the request body, the wire format of the
embeddings, what is retried, and its failures before and without a server.

Against a real `vllm serve` (equal tokens, schema, prefix cache, refusals, retries through a flaky
proxy, abort, the embedded pipeline): tests/vllm/test_openai_server.py, run by `make test-vllm`.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import socket

import httpx
import numpy as np
import pytest
import torch

from storage.errors import is_transient
from tests.vllm.helpers import SCHEMA, encode, random_image, request
from visbatch.settings import Settings
from worker.engines import make_engine, resolve_engine_name
from worker.engines.openai_engine import (
    LLMServerNotConfigured,
    OpenAIEngine,
    OpenAIOptions,
    encode_tensor,
    vllm_serve_args,
)
from worker.engines.vllm_common import VLLMUnsupportedFamily
from worker.retry import RetryPolicy
from worker.tokens.tensors import VisualTokens

KEY = "sk-test-never-shown-0123456789"


def _decode(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def _engine(adapter, **kw) -> OpenAIEngine:
    options = dict(url=f"http://127.0.0.1:{_closed_port()}/v1", api_key=KEY, retry=RetryPolicy(1, 0.01, 0.01))
    return OpenAIEngine(adapter, OpenAIOptions(**{**options, **kw}))


# --- settings ------------------------------------------------------------------------------------


def test_openai_engine_needs_a_url(tiny_adapter, monkeypatch):
    monkeypatch.delenv("VISBATCH_LLM_URL", raising=False)
    with pytest.raises(LLMServerNotConfigured, match="VISBATCH_LLM_URL"):
        make_engine("openai", tiny_adapter, Settings())
    assert resolve_engine_name("openai", tiny_adapter) == "openai"  # explicit: never auto


def test_settings_and_the_api_key(tiny_adapter, monkeypatch, caplog):
    monkeypatch.setenv("VISBATCH_LLM_URL", "http://llm:8000/v1/")
    monkeypatch.setenv("VISBATCH_LLM_MAX_IN_FLIGHT", "7")
    monkeypatch.setenv("VISBATCH_LLM_MAX_RETRIES", "2")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-openai-variable")
    monkeypatch.delenv("VISBATCH_LLM_API_KEY", raising=False)
    options = OpenAIOptions.from_settings(Settings())
    assert options.api_key == "sk-from-openai-variable"
    assert (options.max_in_flight, options.retry.max_retries) == (7, 2)
    assert options.server_root == "http://llm:8000"

    monkeypatch.setenv("VISBATCH_LLM_API_KEY", KEY)  # ours wins
    settings = Settings()
    with caplog.at_level(logging.DEBUG):
        engine = make_engine("openai", tiny_adapter, settings)
        logging.getLogger("test").info(
            "settings %r options %r engine %s", settings, engine.options, vars(engine)
        )
    assert engine.name == "openai" and engine.options.api_key == KEY
    # Never printed: not by the settings, the options, nor the engine's state.
    assert KEY not in repr(settings) and KEY not in str(settings) and KEY not in repr(engine.options)
    assert KEY not in caplog.text


# --- what is retried -----------------------------------------------------------------------------


def _status_error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://llm/v1/chat/completions")
    response = httpx.Response(status, request=request, json={"error": {"message": "x"}})
    return httpx.HTTPStatusError("status", request=request, response=response)


@pytest.mark.parametrize(("status", "transient"), [(500, True), (502, True), (503, True), (429, True),
                                                   (408, True), (400, False), (401, False), (404, False),
                                                   (413, False), (422, False)])  # fmt: skip
def test_http_statuses_worth_another_try(status, transient):
    assert is_transient(_status_error(status)) is transient


def test_network_failures_are_transient_a_bad_url_is_not():
    request = httpx.Request("POST", "http://llm/v1/chat/completions")
    assert is_transient(httpx.ConnectError("refused", request=request))
    assert is_transient(httpx.ReadTimeout("slow", request=request))
    assert is_transient(httpx.RemoteProtocolError("closed mid-answer", request=request))
    assert not is_transient(httpx.UnsupportedProtocol("ftp://", request=request))


# --- the request ---------------------------------------------------------------------------------


def test_tensors_go_as_npy_and_bfloat16_exactly():
    x = torch.randn(5, 7)
    assert np.array_equal(_decode(encode_tensor(x)), x.numpy())
    b = torch.randn(5, 7).to(torch.bfloat16)
    decoded = _decode(encode_tensor(b))
    assert decoded.dtype == np.float32
    # Every bfloat16 is a float32: the server's cast back gives the very same values.
    assert torch.equal(torch.from_numpy(decoded).to(torch.bfloat16), b)


def test_request_body(tiny_adapter):
    (vt,) = encode(tiny_adapter, [random_image(448, 448, seed=1)])
    engine = _engine(tiny_adapter)
    greedy = engine.request_body(request(tiny_adapter, vt, "page-1", "What is the total?"))
    (message,) = greedy["messages"]
    image, text = message["content"]
    assert text == {"type": "text", "text": "What is the total?"}
    assert image["type"] == "image_embeds" and image["uuid"] == "page-1"
    embeds = _decode(image["image_embeds"]["image_embeds"])
    assert np.array_equal(embeds, vt.embeds.numpy())
    assert image["image_embeds"]["image_grid_thw"] == vt.grid_thw.reshape(-1).tolist()
    # Greedy: the in-process engine's values, every one set (the server would fill unset ones).
    assert {k: greedy[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "n")} == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "n": 1,
    }  # fmt: skip
    assert greedy["max_tokens"] == 12 and greedy["return_token_ids"] is True
    assert "seed" not in greedy and "model" not in greedy and "structured_outputs" not in greedy

    sampled = engine.request_body(
        request(tiny_adapter, vt, "page-1", "x", temperature=0.7, top_p=0.9, seed=5, json_schema=SCHEMA)
    )
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (0.7, 0.9, 5)
    # The transformers engine's schema string and whitespace rule.
    assert sampled["structured_outputs"] == {
        "json": json.dumps(SCHEMA, sort_keys=True),
        "disable_any_whitespace": True,
    }
    named = _engine(tiny_adapter, model="served-name").request_body(request(tiny_adapter, vt, "k"))
    assert named["model"] == "served-name"
    assert json.dumps(greedy)  # plain JSON all through


def test_qwen3_vl_sends_deepstack_and_needs_the_tower_module(family_model_dir):
    from worker.models import ModelRef, load_adapter
    from worker.models.qwen3_vl import VLLM_MAX_IMAGES

    adapter = load_adapter(ModelRef(str(family_model_dir("qwen3_vl"))))
    (vt,) = encode(adapter, [random_image(320, 256, seed=2)])
    image = _engine(adapter).request_body(request(adapter, vt, "q3"))["messages"][0]["content"][0]
    embeds = _decode(image["image_embeds"]["image_embeds"])
    layers = vt.extras["deepstack"].shape[0]
    assert embeds.shape == (vt.num_tokens, adapter.hidden_size * (1 + layers))
    flags = vllm_serve_args(adapter)
    # Images allowed (the tower module exists, for deepstack), up to a window's worth.
    limits = json.loads(flags[flags.index("--limit-mm-per-prompt") + 1])
    assert limits == {"image": VLLM_MAX_IMAGES, "video": 0} and VLLM_MAX_IMAGES > 1


def test_idefics3_needs_a_server_with_the_plugin(family_model_dir):
    """vLLM's own Idefics3 takes no embeddings: only a server with visbatch's plugin loaded does
    (tests/vllm/test_openai_plugin_families.py runs one)."""
    from worker.models import ModelRef, load_adapter

    adapter = load_adapter(ModelRef(str(family_model_dir("idefics3"))))
    with pytest.raises(
        VLLMUnsupportedFamily, match="openai cannot run idefics3: .*VISBATCH_LLM_SERVER_PLUGIN"
    ):
        _engine(adapter)
    _engine(adapter, server_plugin=True).close()


# --- failures without a server -------------------------------------------------------------------


def test_bad_requests_fail_before_the_server(tiny_adapter):
    (vt,) = encode(tiny_adapter, [random_image(448, 448, seed=3)])
    good = request(tiny_adapter, vt, "k")
    wrong_hidden = VisualTokens(
        embeds=torch.zeros(vt.num_tokens, tiny_adapter.hidden_size + 1), grid_thw=vt.grid_thw
    )
    at = good.prompt_ids.index(tiny_adapter.image_token_id)
    one_placeholder_short = good.prompt_ids[:at] + good.prompt_ids[at + 1 :]
    engine = _engine(tiny_adapter)
    out = engine.generate(
        [
            dataclasses.replace(good, visual=wrong_hidden),
            dataclasses.replace(good, prompt=None),
            dataclasses.replace(good, prompt_ids=one_placeholder_short),
        ]
    )
    assert "rejected before the server" in out[0].error and "do not fit" in out[0].error
    assert "needs the prompt text" in out[1].error
    assert "rejected before the server" in out[2].error and "placeholders" in out[2].error
    assert engine.retries == 0 and engine.unfinished == 0  # nothing reached the network
    engine.close()


def test_an_unreachable_server_fails_the_request_after_its_retries(tiny_adapter, caplog):
    (vt,) = encode(tiny_adapter, [random_image(448, 448, seed=4)])
    engine = _engine(tiny_adapter)  # a port nobody listens on; 1 retry
    with caplog.at_level(logging.WARNING):
        (out,) = engine.generate([request(tiny_adapter, vt, "k")])
    assert out.finish_reason == "error"
    assert "failed 2 tries" in out.error and "ConnectError" in out.error, out.error
    assert engine.retries == 1 and "retrying" in caplog.text
    assert KEY not in caplog.text and KEY not in out.error
    engine.close()


def test_abort_drops_the_request(tiny_adapter):
    (vt,) = encode(tiny_adapter, [random_image(448, 448, seed=5)])
    engine = _engine(tiny_adapter, retry=RetryPolicy(3, 5.0, 5.0))  # in backoff for seconds
    engine.add("a", request(tiny_adapter, vt, "k"))
    engine.add("b", request(tiny_adapter, vt, "k"))
    assert engine.unfinished == 2
    engine.request_abort(["a", "b"])
    assert engine.step() == [] and engine.unfinished == 0
    engine.close()
