"""Engines behind one interface; the pipeline picks one by name and never branches on it: what
it must know of an engine (does it need the adapter's language model, how many requests to keep
in flight, can it take the model's family) the engine's class answers (worker.engines.base), found
here by name (`engine_class`; `choose_engine`, `needs_language_model`, `default_window`,
`make_engine` ask it).

`VISBATCH_ENGINE` is `vllm`, `transformers`, `openai`, or `auto` (the default): vLLM where it can
be imported, the model runs on a GPU and vLLM can take the family's cached tokens; transformers
everywhere else (a laptop, CI, a CPU worker, an Idefics3, InternVL or LLaVA-OneVision model).
`openai` is never picked by `auto`: it sends the cached tokens to a running `vllm serve` at
`VISBATCH_LLM_URL`. `load` is for capacity tests only (fixed answers after a GPU-like delay, no
model compute: load_engine.py); `auto` never picks it.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from worker.engines.base import Engine, EngineRequest, Generation, RequestRejected, StepEngine

if TYPE_CHECKING:
    from visbatch.settings import Settings
    from worker.models.base import ModelAdapter

log = logging.getLogger(__name__)

# Each engine's class, as "module:Class": a module is imported when its engine is first asked
# about, and only its own (vLLM and transformers are imported by their engines when they start
# or run a batch, never to read a class).
_REGISTRY: dict[str, str] = {
    "vllm": "worker.engines.vllm_engine:VLLMEngine",
    "transformers": "worker.engines.transformers_engine:TransformersEngine",
    "openai": "worker.engines.openai_engine:OpenAIEngine",
    "load": "worker.engines.load_engine:LoadEngine",
}
ENGINES = tuple(_REGISTRY)


def engine_class(name: str) -> type[StepEngine]:
    """The class of engine `name` (not `auto`: resolve_engine_name first); ValueError naming
    every engine when there is none of that name."""
    where = _REGISTRY.get(name)
    if where is None:
        raise ValueError(f"unknown engine {name!r} (available: auto, {', '.join(ENGINES)})")
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


def choose_engine(setting: str, adapter: ModelAdapter, settings: Settings | None = None) -> str:
    """The engine `setting` (VISBATCH_ENGINE) means for this model, resolved once for a runtime;
    the engine's refusal (VLLMUnsupportedFamily, an UnsupportedModel, from a vLLM engine) when it
    cannot take the model's family with these settings: said as the job starts, before any
    weight loads."""
    name = resolve_engine_name(setting, adapter)
    engine_class(name).refuse_family(adapter, settings)
    return name


def needs_language_model(name: str) -> bool:
    """Whether the engine generates with the adapter's own language model (transformers); the
    others take the cached tokens elsewhere, so only the vision tower loads in this process."""
    return engine_class(name).needs_language_model


def default_window(name: str, max_batch_size: int) -> int:
    """Requests kept in flight in the engine when VISBATCH_GENERATE_WINDOW is not set."""
    return engine_class(name).default_window(max_batch_size)


def resolve_engine_name(name: str, adapter: ModelAdapter) -> str:
    """The engine `name` means for this model: `auto` becomes vllm or transformers."""
    if name != "auto":
        return name
    from worker.engines.vllm_engine import vllm_available

    unsupported = getattr(adapter, "vllm_unsupported", None)
    if unsupported and adapter.device.type == "cuda":
        log.info("VISBATCH_ENGINE=auto: transformers for %s (%s)", adapter.family, unsupported)
        return "transformers"
    # The adapter's device follows VISBATCH_DEVICE, so VISBATCH_DEVICE=cpu also means transformers.
    return "vllm" if adapter.device.type == "cuda" and vllm_available() else "transformers"


def make_engine(name: str, adapter: ModelAdapter, settings: Settings | None = None) -> Engine:
    """Build the engine `name` (vllm, transformers, openai, load or auto); the knobs come from
    `settings` (None: the environment's, or the engine's own defaults where it has them)."""
    return engine_class(resolve_engine_name(name, adapter)).from_settings(adapter, settings)


__all__ = [
    "ENGINES",
    "Engine",
    "EngineRequest",
    "Generation",
    "RequestRejected",
    "StepEngine",
    "choose_engine",
    "default_window",
    "engine_class",
    "make_engine",
    "needs_language_model",
    "resolve_engine_name",
]
