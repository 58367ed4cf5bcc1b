"""The generate stage: requests (unit x prompt) packed by tokens, fed cached visual tokens, stored."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ingest.budget import PixelBounds
from ingest.spec import JobSpec
from storage.rows import ResultRow
from worker.encode import VisualTokenStore
from worker.engines.base import Engine, EngineRequest, Generation
from worker.models.base import ModelAdapter
from worker.packing import Batch, PackItem, pack_by_tokens
from worker.structured import validate_output

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestRef:
    """One request: a unit asked one of its job's prompts. Small: tensors are loaded per batch.

    Requests of different jobs may share a batch (the fleet packs across jobs), so each
    carries its job's spec.
    """

    job_id: str
    unit_id: int
    prompt_index: int
    image_key: str
    visual_tokens: int
    cache_hit: bool
    spec: JobSpec = field(compare=False, hash=False, repr=False)
    # The unit's resize bounds (its job's budget); None: the model's own. Part of the cache key.
    bounds: PixelBounds | None = None

    @property
    def prompt(self) -> str:
        return self.spec.prompts[self.prompt_index]


class GenerateStage:
    def __init__(
        self,
        adapter: ModelAdapter,
        engine: Engine,
        tokens: VisualTokenStore,
        *,
        token_budget: int,
        max_batch_size: int,
        model_name: str,
    ) -> None:
        self.adapter = adapter
        self.engine = engine
        self.tokens = tokens
        self.token_budget = token_budget
        self.max_batch_size = max_batch_size
        self.model_name = model_name
        self._text_tokens: dict[str, int] = {}

    def text_tokens(self, prompt: str) -> int:
        """Prompt tokens besides the image placeholders (template included)."""
        if prompt not in self._text_tokens:
            self._text_tokens[prompt] = len(self.adapter.prompt_ids(prompt, None))
        return self._text_tokens[prompt]

    def plan(self, requests: Iterable[RequestRef]) -> list[Batch[RequestRef]]:
        """Pack by tokens; requests with different sampling settings never share a batch."""
        items = [
            PackItem(
                payload=r,
                input_tokens=r.visual_tokens + self.text_tokens(r.prompt),
                max_new_tokens=r.spec.sampling.max_new_tokens,
                group=(r.spec.sampling.temperature, r.spec.sampling.top_p, r.spec.sampling.seed),
                affinity=r.image_key,
            )
            for r in requests
        ]
        return pack_by_tokens(items, token_budget=self.token_budget, max_batch_size=self.max_batch_size)

    def run_batch(self, batch: Batch[RequestRef]) -> list[tuple[RequestRef, ResultRow]]:
        """Generate one packed batch; one result row per request, errors included."""
        refs = [item.payload for item in batch.items]
        prepared: list[EngineRequest | str] = [self._prepare(r) for r in refs]
        ready = [i for i, p in enumerate(prepared) if isinstance(p, EngineRequest)]
        started = time.perf_counter()
        generations = self._generate([prepared[i] for i in ready])
        latency_ms = (time.perf_counter() - started) * 1000.0
        by_index = dict(zip(ready, generations, strict=True))
        rows = []
        for i, ref in enumerate(refs):
            outcome = by_index.get(i, prepared[i])
            rows.append((ref, self._row(ref, prepared[i], outcome, latency_ms)))
        return rows

    def _prepare(self, ref: RequestRef) -> EngineRequest | str:
        try:
            visual = self.tokens.get(ref.image_key, ref.bounds)
        except Exception as exc:
            return f"visual tokens unavailable: {type(exc).__name__}: {exc}"
        spec, s = ref.spec, ref.spec.sampling
        return EngineRequest(
            prompt_ids=self.adapter.prompt_ids(ref.prompt, visual),
            visual=visual,
            cache_key=self.tokens.cache_key(ref.image_key, ref.bounds),
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            json_schema=spec.json_schema,
            prune_keep=spec.budget.prune_keep,
            merge_keep=spec.budget.merge_keep,
        )

    def _generate(self, requests: list[EngineRequest]) -> list[Generation | str]:
        if not requests:
            return []
        try:
            return list(self.engine.generate(requests))
        except Exception as exc:
            if len(requests) == 1:
                log.warning("generation failed: %s", exc)
                return [f"generation failed: {type(exc).__name__}: {exc}"]
            # One bad request (or memory pressure) must not fail its neighbours: halve and retry.
            log.warning("batch of %d failed (%s); splitting", len(requests), exc)
            mid = len(requests) // 2
            return self._generate(requests[:mid]) + self._generate(requests[mid:])

    def _row(
        self,
        ref: RequestRef,
        prepared: EngineRequest | str,
        outcome: Generation | str,
        latency_ms: float,
    ) -> ResultRow:
        prompt_tokens = (
            len(prepared.prompt_ids) - prepared.visual.num_tokens
            if isinstance(prepared, EngineRequest)
            else self.text_tokens(ref.prompt)
        )
        common = dict(
            unit_id=ref.unit_id,
            prompt_index=ref.prompt_index,
            prompt_tokens=prompt_tokens,
            visual_tokens=ref.visual_tokens,
            model=self.model_name,
            engine=self.engine.name,
            cache_hit=ref.cache_hit,
            latency_ms=latency_ms,
        )
        if isinstance(outcome, Generation) and outcome.error is not None:
            outcome = outcome.error  # the engine refused this request alone; its batch-mates ran
        if isinstance(outcome, str):
            return ResultRow(
                output=None, text=None, error=outcome, completion_tokens=0, finish_reason=None, **common
            )
        output, error = None, None
        spec = ref.spec
        if spec.json_schema is not None:
            output, error = validate_output(outcome.text, spec.json_schema)
            if error and outcome.finish_reason == "length":
                error += f" (cut off at max_new_tokens={spec.sampling.max_new_tokens})"
        return ResultRow(
            output=output,
            text=outcome.text,
            error=error,
            completion_tokens=len(outcome.token_ids),
            finish_reason=outcome.finish_reason,
            pruned_tokens=outcome.pruned_tokens,
            merged_tokens=outcome.merged_tokens,
            **common,
        )
