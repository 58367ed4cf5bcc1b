"""Which engine VISBATCH_ENGINE gives, and the error where vLLM is missing.

These need no running vLLM (availability is faked), so they run in every venv; the tests that
start vLLM (test_vllm_engine.py) skip where it cannot be imported.
"""

from __future__ import annotations

import pytest
import torch

from visbatch.settings import Settings
from worker.engines import make_engine, resolve_engine_name
from worker.engines import vllm_engine as vllm_module
from worker.engines.vllm_common import VLLMUnsupportedFamily


class FakeAdapter:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


@pytest.mark.parametrize(
    ("device", "importable", "expected"),
    [("cuda", True, "vllm"), ("cuda", False, "transformers"), ("cpu", True, "transformers")],
)
def test_auto_is_vllm_only_with_vllm_and_a_gpu(monkeypatch, device, importable, expected):
    monkeypatch.setattr(vllm_module, "vllm_available", lambda: importable)
    assert resolve_engine_name("auto", FakeAdapter(device)) == expected
    # Explicit names are kept as they are.
    assert resolve_engine_name("transformers", FakeAdapter(device)) == "transformers"
    assert resolve_engine_name("vllm", FakeAdapter(device)) == "vllm"


def test_default_engine_is_auto(monkeypatch):
    monkeypatch.delenv("VISBATCH_ENGINE", raising=False)
    assert Settings().engine == "auto"


def test_vllm_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("VISBATCH_VLLM_MAX_NUM_SEQS", "64")
    monkeypatch.setenv("VISBATCH_VLLM_MAX_NUM_BATCHED_TOKENS", "8192")
    monkeypatch.setenv("VISBATCH_VLLM_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("VISBATCH_VLLM_MAX_MODEL_LEN", "16384")
    monkeypatch.setenv("VISBATCH_VLLM_TENSOR_PARALLEL_SIZE", "2")
    options = vllm_module.VLLMOptions.from_settings(Settings())
    assert options.llm_kwargs() == {
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 64,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 16384,
        "tensor_parallel_size": 2,
        "enforce_eager": False,
    }


def test_asking_for_vllm_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(vllm_module, "vllm_available", lambda: False)
    with pytest.raises(vllm_module.VLLMUnavailable, match=r"pip install 'visbatch\[gpu\]'"):
        make_engine("vllm", FakeAdapter("cuda"), Settings())


def test_vllm_engine_is_built_lazily_from_settings(monkeypatch):
    # Construction never imports vLLM nor starts it: the LLM starts on the first batch.
    monkeypatch.setattr(vllm_module, "vllm_available", lambda: True)
    engine = make_engine("vllm", FakeAdapter("cuda"), Settings(vllm_max_num_seqs=7))
    assert engine.name == "vllm"
    assert engine.options.max_num_seqs == 7


def test_unknown_engine(monkeypatch):
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tensorrt", FakeAdapter("cpu"), Settings())


class FamilyAdapter(FakeAdapter):
    """An adapter of a family vLLM cannot take (Idefics3's reason), or of one it can."""

    def __init__(self, device: str, unsupported: str | None) -> None:
        super().__init__(device)
        self.family = "idefics3" if unsupported else "qwen3_vl"
        self.vllm_unsupported = unsupported


REASON = "vLLM builds its prompt from the pixel size"


def test_auto_picks_transformers_for_a_family_vllm_cannot_take(monkeypatch):
    monkeypatch.setattr(vllm_module, "vllm_available", lambda: True)
    assert resolve_engine_name("auto", FamilyAdapter("cuda", REASON)) == "transformers"
    assert resolve_engine_name("auto", FamilyAdapter("cuda", None)) == "vllm"  # Qwen3-VL: vLLM takes it


def test_asking_vllm_for_such_a_family_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(vllm_module, "vllm_available", lambda: True)
    with pytest.raises(VLLMUnsupportedFamily, match=r"cannot run idefics3: vLLM builds .*transformers"):
        make_engine("vllm", FamilyAdapter("cuda", REASON), Settings())


def test_real_adapters_say_whether_vllm_takes_them():
    from tests.model_fixtures import FAMILIES
    from worker.models import adapter_class

    # Every family; LLaVA-OneVision, InternVL and Idefics3 through visbatch's vLLM plugin
    # (tests/vllm/test_vllm_plugin_families.py).
    assert [f for f in FAMILIES if adapter_class(f).vllm_unsupported is not None] == []
    assert {f for f in FAMILIES if adapter_class(f).vllm_needs_plugin} == {
        "llava_onevision",
        "internvl",
        "idefics3",
    }


@pytest.mark.parametrize("family", ["llava_onevision", "internvl", "idefics3"])
def test_plugin_families_run_on_vllm_in_process_and_on_a_server_said_to_have_the_plugin(monkeypatch, family):
    """LLaVA-OneVision, InternVL and Idefics3 need visbatch's vLLM plugin (vllm_models.py):
    `auto` picks vLLM for them as for Qwen, the in-process engine takes them, and the openai engine
    refuses them at job start, before any request (a `vllm serve` started without visbatch would
    die on two page sizes), unless VISBATCH_LLM_SERVER_PLUGIN says its server has the plugin
    (tests/vllm/test_openai_plugin_families.py runs such a server)."""
    from worker.engines.openai_engine import OpenAIEngine, OpenAIOptions
    from worker.models import adapter_class

    real = adapter_class(family)
    adapter = FamilyAdapter("cuda", real.vllm_unsupported)
    adapter.family, adapter.vllm_needs_plugin = family, real.vllm_needs_plugin
    monkeypatch.setattr(vllm_module, "vllm_available", lambda: True)
    assert resolve_engine_name("auto", adapter) == "vllm"
    vllm_module.VLLMEngine.refuse_family(adapter)  # nothing raised: the plugin is loaded in process
    with pytest.raises(VLLMUnsupportedFamily, match=rf"openai cannot run {family}: .*visbatch's vLLM plugin"):
        OpenAIEngine(adapter, OpenAIOptions(url="http://127.0.0.1:9/v1"))  # nothing is contacted
    with pytest.raises(VLLMUnsupportedFamily, match="VISBATCH_LLM_SERVER_PLUGIN=true"):
        OpenAIEngine.refuse_family(adapter, Settings())
    # A server that runs where visbatch is installed has the plugin: the operator says so.
    OpenAIEngine.refuse_family(adapter, Settings(llm_server_plugin=True))
    OpenAIEngine(adapter, OpenAIOptions(url="http://127.0.0.1:9/v1", server_plugin=True)).close()
