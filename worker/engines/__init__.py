"""Engines behind one interface; the pipeline picks one by name and never branches on it."""

from __future__ import annotations

from worker.engines.base import Engine, EngineRequest, Generation
from worker.models.base import ModelAdapter


def make_engine(name: str, adapter: ModelAdapter) -> Engine:
    if name == "transformers":
        from worker.engines.transformers_engine import TransformersEngine

        return TransformersEngine(adapter)
    raise ValueError(f"unknown engine {name!r} (available: transformers)")


__all__ = ["Engine", "EngineRequest", "Generation", "make_engine"]
