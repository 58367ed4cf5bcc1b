"""Generation with transformers from cached visual tokens: the vision tower never runs here.

transformers generates static batches (every row padded to the longest prompt, the batch runs
until its longest answer ends), so each `step` packs what is queued by token count
(worker.tokens.packing) and runs ONE batch: the one holding the oldest queued request, so nothing
waits forever behind a stream of better-fitting newcomers. After the engine has been idle the
batches start small and double (1, 2, 4 ... up to max_batch_size), like TCP's slow start: the
first answers of a job come after one request's worth of compute, not a full batch's, and a busy
engine runs full batches. A cancelled request stops at the
next decode step (a per-row stopping criterion), and a batch that fails is halved and retried,
so one bad request fails alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import groupby
from typing import TYPE_CHECKING

import torch

from worker.engines.base import EngineRequest, Generation, StepEngine
from worker.models.base import ModelAdapter
from worker.tokens.packing import PackItem, pack_by_tokens

if TYPE_CHECKING:
    from visbatch.settings import Settings

log = logging.getLogger(__name__)

# Defaults of VISBATCH_TOKEN_BUDGET / VISBATCH_MAX_BATCH_SIZE (visbatch.settings).
DEFAULT_BATCH_TOKENS = 16384
DEFAULT_MAX_BATCH_SIZE = 16
# Static batches: a few batches' worth kept in flight to pack from (the default window).
BATCHES_IN_WINDOW = 4


class _StopAborted:
    """Ends the rows whose requests were aborted, at the next decode step: a transformers
    StoppingCriteria (StoppingCriteriaList calls it with the tokens so far, it answers per row),
    not derived from it so that this module imports transformers only when a batch runs: the
    engine's class is read (worker.engines) before any model loads."""

    def __init__(self, row_ids: list[str], aborted: set[str]) -> None:
        self.row_ids = row_ids
        self.aborted = aborted

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if not self.aborted:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done = [request_id in self.aborted for request_id in self.row_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class TransformersEngine(StepEngine):
    name = "transformers"
    needs_language_model = True

    def __init__(
        self,
        adapter: ModelAdapter,
        *,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    ) -> None:
        super().__init__()
        self.adapter = adapter
        self.batch_tokens = batch_tokens
        self.max_batch_size = max_batch_size
        self._queue: dict[str, EngineRequest] = {}  # insertion order = arrival order
        self.batches_run = 0
        self._ramp = 1  # this step's batch size limit: doubles while busy, back to 1 when idle
        self.padding_slots = 0  # input slots that were padding, over every batch run
        self.input_slots = 0

    @classmethod
    def from_settings(cls, adapter: ModelAdapter, settings: Settings | None = None) -> TransformersEngine:
        """None: the engine's own defaults (not the environment's)."""
        if settings is None:
            return cls(adapter)
        return cls(adapter, batch_tokens=settings.token_budget, max_batch_size=settings.max_batch_size)

    @classmethod
    def default_window(cls, max_batch_size: int) -> int:
        return BATCHES_IN_WINDOW * max_batch_size

    # --- the step API ------------------------------------------------------------------------

    def add(self, request_id: str, request: EngineRequest) -> None:
        self._queue[request_id] = request

    @property
    def unfinished(self) -> int:
        return len(self._queue)

    def step(self) -> list[tuple[str, Generation]]:
        for request_id in self._take_aborts(self._queue):
            del self._queue[request_id]
        if not self._queue:
            return []
        batch = self._next_batch()
        requests = [self._queue.pop(request_id) for request_id in batch]
        generations = self._run(batch, requests)
        aborted = self._take_aborts(batch)
        self._ramp = 1 if not self._queue else min(self.max_batch_size, self._ramp * 2)
        return [(rid, gen) for rid, gen in zip(batch, generations, strict=True) if rid not in aborted]

    def _next_batch(self) -> list[str]:
        oldest = next(iter(self._queue))
        items = [
            PackItem(
                payload=request_id,
                input_tokens=len(request.prompt_ids),
                max_new_tokens=request.max_new_tokens,
                group=request.sampling_key,
                affinity=request.cache_key,
            )
            for request_id, request in self._queue.items()
        ]
        batches = pack_by_tokens(items, batch_tokens=self.batch_tokens, max_batch_size=self._ramp)
        chosen = next(b for b in batches if any(item.payload == oldest for item in b.items))
        self.batches_run += 1
        self.padding_slots += chosen.padded_input_tokens - chosen.real_input_tokens
        self.input_slots += chosen.padded_input_tokens
        return [item.payload for item in chosen.items]

    def _run(self, ids: list[str], requests: list[EngineRequest]) -> list[Generation]:
        """One packed batch; on an error, halves it so that one bad request fails alone."""
        try:
            return self._generate(requests, ids)
        except Exception as exc:
            if len(requests) == 1:
                log.warning("generation failed: %s", exc)
                return [Generation.failed(f"generation failed: {type(exc).__name__}: {exc}")]
            log.warning("batch of %d failed (%s); splitting", len(requests), exc)
            mid = len(requests) // 2
            return self._run(ids[:mid], requests[:mid]) + self._run(ids[mid:], requests[mid:])

    # --- one static batch ----------------------------------------------------------------------

    def generate(self, requests: list[EngineRequest]) -> list[Generation]:
        """These requests as ONE batch per sampling setting (no packing): what the equivalence
        tests compare against the pixel path."""
        return self._generate(requests, [f"g{i}" for i in range(len(requests))])

    def _generate(self, requests: list[EngineRequest], ids: list[str]) -> list[Generation]:
        results: dict[int, Generation] = {}

        def key(i: int) -> tuple[tuple[float, float, int], bool]:
            return requests[i].sampling_key, bool(requests[i].images)

        order = sorted(range(len(requests)), key=key)
        # One generate call per sampling setting: transformers applies one setting per call; and
        # text-only requests (a source's summary) apart from those with images.
        for _, group in groupby(order, key=key):
            idx = list(group)
            outputs = self._generate_group([requests[i] for i in idx], [ids[i] for i in idx])
            for i, gen in zip(idx, outputs, strict=True):
                results[i] = gen
        return [results[i] for i in range(len(requests))]

    @torch.inference_mode()
    def _generate_group(self, requests: list[EngineRequest], ids: Iterable[str]) -> list[Generation]:
        from transformers import LogitsProcessorList, StoppingCriteriaList  # loaded with the model

        adapter = self.adapter
        model = adapter.model
        prompts = [r.prompt_ids for r in requests]
        prune_keeps, merge_keeps = [r.prune_keep for r in requests], [r.merge_keep for r in requests]
        pruned = merged = [0] * len(requests)
        if not any(r.images for r in requests):  # text only: no embeddings to place
            input_ids, attention = adapter.left_padded(prompts)
            inputs: dict = {"input_ids": input_ids, "attention_mask": attention}
        elif any(keep < 1.0 for keep in prune_keeps + merge_keeps) or any(
            r.drop_static > 0 and len(r.images) > 1 for r in requests
        ):  # positions kept: worker.tokens.reduction
            # A window's images reduced each on its own, or without its static patches.
            visuals = [r.images if len(r.images) > 1 else r.images[0] for r in requests]
            inputs, pruned, merged = adapter.reduced_generation_inputs(
                prompts, visuals, prune_keeps, merge_keeps, [r.drop_static for r in requests]
            )
        else:
            # Every image of the batch in order, row by row: each family places them over its
            # image placeholders in that order (several per row for a window).
            inputs = adapter.generation_inputs(prompts, [image for r in requests for image in r.images])
        first = requests[0]
        processors = LogitsProcessorList()
        if any(r.json_schema is not None for r in requests):
            from worker.engines.structured import GrammarLogitsProcessor

            vocab = int(model.get_output_embeddings().weight.shape[0])
            processors.append(
                GrammarLogitsProcessor(adapter.tokenizer, vocab, [r.json_schema for r in requests])
            )
        sampling: dict = {"do_sample": False}
        if first.temperature > 0:
            torch.manual_seed(first.seed)
            sampling = {"do_sample": True, "temperature": first.temperature, "top_p": first.top_p}
        output = model.generate(
            **inputs,
            max_new_tokens=max(r.max_new_tokens for r in requests),
            logits_processor=processors,
            stopping_criteria=StoppingCriteriaList([_StopAborted(list(ids), self._aborts)]),
            pad_token_id=adapter.tokenizer.pad_token_id,
            eos_token_id=adapter.eos_token_ids,
            top_k=None,
            **sampling,
        )
        width = inputs["input_ids"].shape[1]
        return [
            self._decode(output[row, width:].tolist(), r.max_new_tokens, pruned[row], merged[row])
            for row, r in enumerate(requests)
        ]

    def _decode(
        self, new_ids: list[int], max_new_tokens: int, pruned_tokens: int = 0, merged_tokens: int = 0
    ) -> Generation:
        eos = set(self.adapter.eos_token_ids)
        new_ids = new_ids[:max_new_tokens]
        finish = "length"
        for pos, tok in enumerate(new_ids):
            if tok in eos:
                new_ids, finish = new_ids[:pos], "stop"
                break
        text = self.adapter.tokenizer.decode(new_ids, skip_special_tokens=True)
        return Generation(
            token_ids=new_ids,
            text=text,
            finish_reason=finish,
            pruned_tokens=pruned_tokens,
            merged_tokens=merged_tokens,
        )
