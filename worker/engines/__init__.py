"""Engines behind one interface; the pipeline picks one by name and never branches on it.

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
            adapter, token_budget=settings.token_budget, max_batch_size=settings.max_batch_size
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
    "make_engine",
    "resolve_engine_name",
]
