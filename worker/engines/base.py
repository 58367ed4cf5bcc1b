"""The engine interface: requests go in as they are ready, generations come out as they finish.

An engine is driven by one thread (the generate stage's loop): `add` requests, call `step`
repeatedly, get back the (request id, Generation) pairs that finished in that step. That lets
the loop keep a window of requests in flight and refill it as requests finish (vLLM schedules
them continuously; the transformers engine packs what is queued by token count into static
batches). `request_abort` may be called from any thread: a cancelled job's requests stop at the
engine's next step (vLLM) or next decode step (transformers), and are never returned.
`generate` is the one-shot form (add everything, step until done) that tests and benchmarks use.

What the pipeline must know of an engine before it builds one (does it need the adapter's language
model, is it fed through vLLM, how many requests to keep in flight, can it take this model's
family) the engine's class answers (`StepEngine`'s class attributes and class methods), so that
nothing else branches on an engine's name; `worker.engines` finds the class by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

from worker.tokens.tensors import VisualTokens

if TYPE_CHECKING:
    from visbatch.settings import Settings
    from worker.models.base import ModelAdapter

# vLLM schedules hundreds of sequences at once (Ray Data LLM keeps 256 per replica), in process or
# as a server, and the load engine stands for a vLLM GPU: the window of an engine that batches
# continuously. (The transformers engine, which runs static batches, keeps a few batches' worth.)
CONTINUOUS_WINDOW = 256


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: list[int]  # chat prompt, image placeholders expanded
    # One image's visual tokens, or several images' in the prompt's order (a window of pages or
    # frames: ModelAdapter.prompt_ids lays them out as the model's processor does).
    visual: VisualTokens | tuple[VisualTokens, ...]
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
    # A window of frames: drop a frame's tokens that changed by less than this (relative L2) since
    # the window last showed their position (transformers engine; 0 = off).
    drop_static: float = 0.0
    # The user's prompt text that `prompt_ids` were built from. An engine that cannot send token ids
    # (the openai engine: vLLM's chat API takes embeddings only in messages) sends it instead and
    # checks that the server's rendering gives back `prompt_ids` exactly.
    prompt: str | None = None
    # A follow-up turn's earlier turns, (question, answer) each, in `prompt_ids` already (the
    # openai engine sends them as messages).
    history: tuple[tuple[str, str], ...] = ()

    @property
    def sampling_key(self) -> tuple[float, float, int]:
        return (self.temperature, self.top_p, self.seed)

    @property
    def images(self) -> tuple[VisualTokens, ...]:
        """The request's images in prompt order (one for a page or a frame)."""
        return self.visual if isinstance(self.visual, tuple) else (self.visual,)

    @property
    def image_keys(self) -> tuple[str, ...]:
        """Each image's own cache key, in prompt order: a window's `cache_key` is its images' keys
        (hex digests) joined by "+" (worker.stages.generate.requests)."""
        keys = tuple(self.cache_key.split("+"))
        if len(keys) != len(self.images):
            raise RequestRejected(f"cache key {self.cache_key!r} does not name {len(self.images)} image(s)")
        return keys

    @property
    def visual_tokens(self) -> int:
        return sum(image.num_tokens for image in self.images)


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

    def add(self, request_id: str, request: EngineRequest) -> None: ...

    def step(self) -> list[tuple[str, Generation]]: ...

    def request_abort(self, request_ids: Iterable[str]) -> None: ...

    def warm_up(self) -> None: ...

    @property
    def unfinished(self) -> int: ...

    def generate(self, requests: list[EngineRequest]) -> list[Generation]: ...


class StepEngine(ABC):
    """What every engine shares: the abort set, and `generate` over add/step; and, asked of the
    class before one is built, what the engine needs (read without importing vLLM or
    transformers: an engine's module imports those where it uses them)."""

    name: ClassVar[str] = "engine"
    # Generates with the adapter's own language model, in this process: the whole model loads.
    # The others take the cached tokens elsewhere, so only the vision tower loads here.
    needs_language_model: ClassVar[bool] = False
    # Feeds the cached tokens to vLLM (in process or a `vllm serve`): a family whose tokens vLLM
    # cannot take is refused (worker.engines.vllm_common.VLLMFedEngine.refuse_family).
    vllm_fed: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_settings(cls, adapter: ModelAdapter, settings: Settings | None = None) -> Self:
        """The engine for `adapter`, its knobs from `settings` (None: the environment's, or the
        engine's own defaults where it has them)."""

    @classmethod
    def default_window(cls, max_batch_size: int) -> int:
        """Requests kept in flight in the engine when VISBATCH_GENERATE_WINDOW is not set."""
        return CONTINUOUS_WINDOW

    @classmethod
    def refuse_family(cls, adapter: ModelAdapter, settings: Settings | None = None) -> None:
        """Raise (an UnsupportedModel) when this engine, with these settings, cannot take the
        adapter's model family: asked as the job starts, before any weight loads. Most engines
        take every family."""
        return None

    def __init__(self) -> None:
        # Written by any thread (set.update is atomic under the GIL), read by the stepping one.
        self._aborts: set[str] = set()

    def request_abort(self, request_ids: Iterable[str]) -> None:
        self._aborts.update(request_ids)

    def warm_up(self) -> None:
        """Load what the first step would (an in-process vLLM builds its LLM here); most have nothing."""
        return None

    def _take_aborts(self, live: Iterable[str]) -> set[str]:
        """The aborts asked for requests still here; forgotten once taken."""
        wanted = self._aborts & set(live)
        self._aborts -= wanted
        return wanted

    def generate(self, requests: list[EngineRequest]) -> list[Generation]:
        """Every request to its end; generations in the order of `requests`."""
        ids = [f"g{i}" for i in range(len(requests))]
        for request_id, request in zip(ids, requests, strict=True):
            self.add(request_id, request)
        done: dict[str, Generation] = {}
        while len(done) < len(ids):
            for request_id, generation in self.step():
                done[request_id] = generation
        return [done[request_id] for request_id in ids]

    @abstractmethod
    def add(self, request_id: str, request: EngineRequest) -> None:
        """Queue one request (ids unique among the unfinished); a request the engine cannot take
        comes back from the next `step` as a failed Generation, never as an exception."""

    @abstractmethod
    def step(self) -> list[tuple[str, Generation]]:
        """Advance the engine; the requests that finished (aborted ones are dropped)."""

    @property
    @abstractmethod
    def unfinished(self) -> int:
        """Requests added and not yet returned by `step` (nor aborted)."""
