"""The engines' registry (worker.engines): each engine's class says what it needs, found by name;
an unknown name is refused with the list of names; the family refusal lives in one place.

No model is built: the classes are read, and engines are built on stand-in adapters (nothing of
theirs is touched before a batch runs).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from visbatch.settings import Settings
from worker.engines import (
    ENGINES,
    choose_engine,
    default_window,
    engine_class,
    make_engine,
    needs_language_model,
)
from worker.engines import vllm_engine as vllm_module
from worker.engines.load_engine import LoadEngine
from worker.engines.openai_engine import OpenAIEngine, OpenAIOptions
from worker.engines.transformers_engine import TransformersEngine
from worker.engines.vllm_common import VLLMFedEngine, VLLMUnsupportedFamily
from worker.engines.vllm_engine import VLLMEngine

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = r"unknown engine 'tensorrt' \(available: auto, vllm, transformers, openai, load\)"
REASON = "vLLM builds its prompt from the pixel size"


def _adapter(unsupported: str | None = None) -> SimpleNamespace:
    """An adapter as far as choosing and building an engine reads one."""
    return SimpleNamespace(family="idefics3" if unsupported else "qwen2_vl", vllm_unsupported=unsupported)


@pytest.mark.parametrize(
    ("name", "cls", "language_model", "vllm_fed", "window"),
    [
        ("vllm", VLLMEngine, False, True, 256),
        ("transformers", TransformersEngine, True, False, 4 * 16),  # static batches: 4 batches' worth
        ("openai", OpenAIEngine, False, True, 256),
        ("load", LoadEngine, False, False, 256),  # it stands for a vLLM GPU
    ],
)
def test_each_engine_says_what_it_needs(name, cls, language_model, vllm_fed, window):
    assert engine_class(name) is cls and cls.name == name
    assert cls.needs_language_model is language_model and needs_language_model(name) is language_model
    assert cls.vllm_fed is vllm_fed and issubclass(cls, VLLMFedEngine) is vllm_fed
    assert cls.default_window(16) == default_window(name, 16) == window


def test_the_registry_names_every_engine_once():
    assert ENGINES == ("vllm", "transformers", "openai", "load")
    assert len({engine_class(name) for name in ENGINES}) == len(ENGINES)


def test_reading_the_classes_imports_neither_vllm_nor_transformers():
    """The registry imports an engine's module, never what it generates with: the adapter is read
    (and the engine chosen) before any weight loads."""
    probe = (
        "import sys\n"
        "from worker.engines import ENGINES, engine_class\n"
        "for name in ENGINES:\n"
        "    cls = engine_class(name)\n"
        "    _ = cls.needs_language_model, cls.vllm_fed, cls.default_window(16)\n"
        "print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize(
    "ask",
    [
        lambda: engine_class("tensorrt"),
        lambda: choose_engine("tensorrt", _adapter()),
        lambda: make_engine("tensorrt", _adapter(), Settings()),
        lambda: needs_language_model("tensorrt"),
        lambda: default_window("tensorrt", 16),
    ],
    ids=["engine_class", "choose_engine", "make_engine", "needs_language_model", "default_window"],
)
def test_an_unknown_engine_is_refused_with_the_names(ask):
    with pytest.raises(ValueError, match=UNKNOWN):
        ask()


@pytest.mark.parametrize("name", ["vllm", "openai"])
def test_the_vllm_fed_engines_refuse_a_family_vllm_cannot_take_at_choice(name):
    with pytest.raises(VLLMUnsupportedFamily, match=rf"VISBATCH_ENGINE={name} cannot run idefics3: {REASON}"):
        choose_engine(name, _adapter(REASON))
    assert choose_engine(name, _adapter()) == name


@pytest.mark.parametrize("name", ["transformers", "load"])
def test_the_other_engines_take_every_family(name):
    assert choose_engine(name, _adapter(REASON)) == name


def test_an_engine_built_directly_refuses_the_family_too(monkeypatch):
    """Built without choose_engine (a test, a benchmark): the same refusal, before anything starts."""
    monkeypatch.setattr(vllm_module, "vllm_available", lambda: True)
    with pytest.raises(VLLMUnsupportedFamily, match="VISBATCH_ENGINE=vllm cannot run idefics3"):
        make_engine("vllm", _adapter(REASON), Settings())
    with pytest.raises(VLLMUnsupportedFamily, match="VISBATCH_ENGINE=openai cannot run idefics3"):
        OpenAIEngine(_adapter(REASON), OpenAIOptions(url="http://127.0.0.1:9/v1"))  # nothing is contacted


def test_the_family_refusal_is_written_once():
    """One definition that refuses (VLLMFedEngine's), one that takes every family (the base's): no
    engine and no caller writes its own."""
    assert VLLMEngine.refuse_family.__func__ is OpenAIEngine.refuse_family.__func__
    assert VLLMEngine.refuse_family.__func__ is VLLMFedEngine.refuse_family.__func__
    defined = sorted(
        path.name
        for path in (ROOT / "worker").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "refuse_family"
    )
    assert defined == ["base.py", "vllm_common.py"]


def test_make_engine_builds_each_from_settings(monkeypatch):
    monkeypatch.setattr(vllm_module, "vllm_available", lambda: True)
    adapter = _adapter()
    vllm = make_engine("vllm", adapter, Settings(vllm_max_num_seqs=7))
    assert isinstance(vllm, VLLMEngine) and vllm.options.max_num_seqs == 7
    transformers = make_engine("transformers", adapter, Settings(token_budget=4096, max_batch_size=3))
    assert (transformers.batch_tokens, transformers.max_batch_size) == (4096, 3)
    own = make_engine("transformers", adapter)  # no settings: the engine's own defaults
    assert (own.batch_tokens, own.max_batch_size) == (16384, 16)
    openai = make_engine("openai", adapter, Settings(llm_url="http://llm:8000/v1", llm_max_in_flight=5))
    assert isinstance(openai, OpenAIEngine) and openai.options.max_in_flight == 5
    adapter.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [7], decode=lambda ids: " ok")
    load = make_engine("load", adapter, Settings(load_tokens_per_s=5.0, load_output_tokens=2))
    assert isinstance(load, LoadEngine) and (load.token_id, load.text) == (7, " ok")
    assert (load.tokens_per_s, load.output_tokens) == (5.0, 2)
