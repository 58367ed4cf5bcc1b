"""Engines behind one interface; the pipeline picks one by name and never branches on it: what
it must know of an engine (does it need the adapter's language model, how many requests to keep
in flight) is asked here (`choose_engine`, `needs_language_model`, `default_window`).

`VISBATCH_ENGINE` is `vllm`, `transformers`, `openai`, or `auto` (the default): vLLM where it can
be imported, the model runs on a GPU and vLLM can take the family's cached tokens; transformers
everywhere else (a laptop, CI, a CPU worker, an Idefics3, InternVL or LLaVA-OneVision model).
`openai` is never picked by `auto`: it sends the cached tokens to a running `vllm serve` at
`VISBATCH_LLM_URL`. `load` is for capacity tests only (fixed answers after a GPU-like delay, no
model compute: load_engine.py); `auto` never picks it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from worker.engines.base import Engine, EngineRequest, Generation, RequestRejected

if TYPE_CHECKING:
    from visbatch.settings import Settings
    from worker.models.base import ModelAdapter

log = logging.getLogger(__name__)

ENGINES = ("vllm", "transformers", "openai", "load")
# Fed the cached tokens through vLLM (in process, or a `vllm serve`): a family whose tokens vLLM
# cannot take is refused by these.
_VLLM_FED = ("vllm", "openai")
# vLLM schedules hundreds of sequences at once (Ray Data LLM keeps 256 per replica), in process or
# as a server; the load engine stands for a vLLM GPU. transformers runs static batches: a few
# batches' worth to pack from.
_VLLM_WINDOW = 256
_BATCHES_IN_WINDOW = 4


def choose_engine(setting: str, adapter: ModelAdapter) -> str:
    """The engine `setting` (VISBATCH_ENGINE) means for this model, resolved once for a runtime;
    VLLMUnsupportedFamily (an UnsupportedModel) when it is a vLLM engine and vLLM cannot take the
    family's cached tokens: said as the job starts, before any weight loads."""
    name = resolve_engine_name(setting, adapter)
    if name not in ENGINES:
        raise ValueError(f"unknown engine {setting!r} (available: auto, {', '.join(ENGINES)})")
    if name in _VLLM_FED:
        from worker.engines.vllm_common import refuse_unsupported_family

        refuse_unsupported_family(name, adapter)
    return name


def needs_language_model(name: str) -> bool:
    """Whether the engine generates with the adapter's own language model (transformers); the
    others take the cached tokens elsewhere, so only the vision tower loads in this process."""
    return name == "transformers"


def default_window(name: str, max_batch_size: int) -> int:
    """Requests kept in flight in the engine when VISBATCH_GENERATE_WINDOW is not set."""
    return _BATCHES_IN_WINDOW * max_batch_size if name == "transformers" else _VLLM_WINDOW


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
    """Build the engine `name` (vllm, transformers, openai or auto); the knobs come from `settings`."""
    resolved = resolve_engine_name(name, adapter)
    if resolved == "transformers":
        from worker.engines.transformers_engine import TransformersEngine

        if settings is None:
            return TransformersEngine(adapter)
        return TransformersEngine(
            adapter, batch_tokens=settings.token_budget, max_batch_size=settings.max_batch_size
        )
    if resolved == "vllm":
        from visbatch.settings import Settings
        from worker.engines.vllm_engine import VLLMEngine, VLLMOptions

        return VLLMEngine(adapter, VLLMOptions.from_settings(settings or Settings()))
    if resolved == "load":  # capacity tests only (bench/control_plane.py)
        from visbatch.settings import Settings
        from worker.engines.load_engine import make_load_engine

        return make_load_engine(adapter, settings or Settings())
    if resolved == "openai":
        from visbatch.settings import Settings
        from worker.engines.openai_engine import OpenAIEngine, OpenAIOptions

        return OpenAIEngine(adapter, OpenAIOptions.from_settings(settings or Settings()))
    raise ValueError(f"unknown engine {name!r} (available: auto, {', '.join(ENGINES)})")


__all__ = [
    "ENGINES",
    "Engine",
    "EngineRequest",
    "Generation",
    "RequestRejected",
    "choose_engine",
    "default_window",
    "make_engine",
    "needs_language_model",
    "resolve_engine_name",
]
