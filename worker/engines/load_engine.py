"""A load-generating engine for CAPACITY TESTS ONLY: no model compute, fixed answers, GPU-like timing.

`VISBATCH_ENGINE=load` (never chosen by `auto`, never a default) makes a worker behave, towards
PostgreSQL, the broker, Redis and S3, like a worker with a GPU, without one: every request is
answered with the same fixed tokens after the time a GPU would take for it, and the pipeline
stores those answers like any other (results rows, counters, job closing). It exists so that
bench/control_plane.py can raise the number of "GPUs" until a service saturates; its answers
mean nothing.

Timing: one engine is one GPU that works through its requests' tokens at
`VISBATCH_LOAD_TOKENS_PER_S` (prefill + decode tokens per second; default 20,000, the planner's
stated per-GPU assumption for a 2B-7B VLM on one H100-class GPU, docs/budget.md). A request
costs its visual + prompt tokens plus its new tokens (`min(max_new_tokens,
VISBATCH_LOAD_OUTPUT_TOKENS)`), or `VISBATCH_LOAD_REQUEST_TOKENS` when set (e.g. 1,650: a 7B
model's ~1,518 visual tokens for a 1288-px page, a 30-token prompt and ~100 new tokens, so a tiny
test model loads the services like a real one). Each request's cost is jittered (lognormal,
sigma 0.2, seeded) and requests finish one after another at that rate: like a continuously
batching server at full load, the GPU's throughput, not one request's latency, sets the pace.
"""

from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING

from worker.engines.base import EngineRequest, Generation, StepEngine

if TYPE_CHECKING:
    from visbatch.settings import Settings
    from worker.models.base import ModelAdapter

# Default GPU throughput: the assumption docs/budget.md states for `visbatch plan`.
DEFAULT_TOKENS_PER_S = 20_000.0
DEFAULT_OUTPUT_TOKENS = 8
JITTER_SIGMA = 0.2
# The longest one step sleeps: the generate loop polls for cancels and flushes between steps.
MAX_STEP_SLEEP_S = 0.05


class LoadEngine(StepEngine):
    """Fixed answers at a calibrated token rate: capacity tests of the services only."""

    name = "load"

    def __init__(
        self,
        token_id: int,
        text: str,
        *,
        tokens_per_s: float = DEFAULT_TOKENS_PER_S,
        output_tokens: int = DEFAULT_OUTPUT_TOKENS,
        request_tokens: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if tokens_per_s <= 0:
            raise ValueError("VISBATCH_LOAD_TOKENS_PER_S must be positive")
        self.token_id = token_id
        self.text = text
        self.tokens_per_s = tokens_per_s
        self.output_tokens = output_tokens
        self.request_tokens = request_tokens
        self._random = random.Random(seed)
        self._finish: dict[str, tuple[float, int]] = {}  # request id -> (finishes at, new tokens)
        self._busy_until = 0.0  # the emulated GPU is busy until then
        self.tokens_served = 0

    @classmethod
    def from_settings(cls, adapter: ModelAdapter, settings: Settings | None = None) -> LoadEngine:
        """The load engine for `adapter`'s tokenizer (its answers decode like real tokens)."""
        from visbatch.settings import Settings

        settings = settings or Settings()
        tokenizer = adapter.tokenizer
        token_id = tokenizer.encode(" ok", add_special_tokens=False)[0]
        return cls(
            token_id,
            tokenizer.decode([token_id]),
            tokens_per_s=settings.load_tokens_per_s,
            output_tokens=settings.load_output_tokens,
            request_tokens=settings.load_request_tokens,
        )

    def cost_tokens(self, request: EngineRequest) -> tuple[int, int]:
        """(tokens this request costs the emulated GPU, new tokens it answers with)."""
        new = max(1, min(request.max_new_tokens, self.output_tokens))
        if self.request_tokens is not None:
            return self.request_tokens, new
        return len(request.prompt_ids) + new, new

    def add(self, request_id: str, request: EngineRequest) -> None:
        cost, new = self.cost_tokens(request)
        seconds = cost / self.tokens_per_s * math.exp(self._random.gauss(0.0, JITTER_SIGMA))
        self._busy_until = max(self._busy_until, time.monotonic()) + seconds
        self._finish[request_id] = (self._busy_until, new)
        self.tokens_served += cost

    @property
    def unfinished(self) -> int:
        return len(self._finish)

    def step(self) -> list[tuple[str, Generation]]:
        for request_id in self._take_aborts(self._finish):
            del self._finish[request_id]
        if not self._finish:
            return []
        first = min(at for at, _ in self._finish.values())
        wait = first - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, MAX_STEP_SLEEP_S))
        now = time.monotonic()
        done = [(rid, new) for rid, (at, new) in self._finish.items() if at <= now]
        for request_id, _ in done:
            del self._finish[request_id]
        return [(request_id, self._answer(new)) for request_id, new in done]

    def _answer(self, new_tokens: int) -> Generation:
        return Generation(
            token_ids=[self.token_id] * new_tokens,
            text=self.text * new_tokens,
            finish_reason="length",
        )
