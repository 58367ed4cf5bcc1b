"""The engine interface: a batch of prepared requests in, one generation per request out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.visual_tokens import VisualTokens


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: list[int]  # chat prompt, image placeholders expanded
    visual: VisualTokens
    cache_key: str  # identifies the image content + preprocessing + model (prefix-cache id)
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    json_schema: dict[str, Any] | None = field(default=None, hash=False)
    # Share of the image's visual tokens given to the LM (transformers engine; 1.0 = all).
    prune_keep: float = 1.0
    # Share of the image's visual tokens left after merging similar neighbours (transformers engine).
    merge_keep: float = 1.0

    @property
    def sampling_key(self) -> tuple[float, float, int]:
        return (self.temperature, self.top_p, self.seed)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (end of sequence) or "length" (max_new_tokens reached)
    # Set when the engine refused this one request (e.g. visual tokens that do not fit the model):
    # the request fails alone and its batch-mates are generated, never a dead engine.
    error: str | None = None
    # Prompt tokens the engine's prefix cache served (None: the engine has no prefix cache).
    cached_tokens: int | None = None
    # Visual tokens left out of the LM input by pruning (0: none, or an engine that cannot prune).
    pruned_tokens: int = 0
    # Visual tokens merged into a neighbour before the LM (0: none, or an engine that cannot merge).
    merged_tokens: int = 0

    @classmethod
    def failed(cls, error: str) -> Generation:
        return cls(token_ids=[], text="", finish_reason="error", error=error)


class RequestRejected(ValueError):
    """One request cannot be given to the engine as it is (shape, dtype, length); others can."""


class Engine(Protocol):
    name: str

    def generate(self, requests: list[EngineRequest]) -> list[Generation]: ...
