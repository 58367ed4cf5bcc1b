"""From a unit and its job's prompts to engine requests, and from generations to result rows.

A unit's visual tokens are read from the cache once and shared by all its prompts, whose
requests reach the engine together (so vLLM's prefix cache serves the image's blocks to every
prompt after the first). A window (ingest.windows) is one request per prompt whose images are
its units' cached tokens in order, laid out as the model's processor lays out several images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ingest.budget import PixelBounds
from ingest.spec import JobSpec
from storage.rows import ResultRow, UnitTask, WindowTask
from storage.summaries import SourceTask
from worker.engines.base import EngineRequest, Generation
from worker.engines.structured import validate_output
from worker.models.base import ModelAdapter
from worker.tokens.store import VisualTokenStore
from worker.tokens.tensors import VisualTokens

# A follow-up turn's earlier turns: (question, answer) each, in order.
History = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Question:
    """One question a unit (or window) is asked: a prompt's turn, after its earlier turns."""

    prompt_index: int
    turn: int = 0
    history: History = ()


@dataclass
class SummaryChain:
    """The stages of one source's summary (worker.stages.generate.summaries): the texts the
    current stage summarizes, the answers of its parts so far."""

    task: SourceTask
    spec: JobSpec
    texts: list[str]
    stage: int = 0
    parts: int = 0
    answers: dict[int, str] = field(default_factory=dict)
    final: bool = False


@dataclass(frozen=True)
class Prepared:
    """One request ready for the engine, or the reason it cannot be asked (`error`)."""

    unit: UnitTask | WindowTask | SourceTask
    spec: JobSpec
    prompt_index: int
    request: EngineRequest | None
    error: str | None = None
    turn: int = 0
    history: History = ()
    # A source's summary (worker.stages.generate.summaries): its chain, and which part of the
    # chain's current stage this request is (the final request has the chain's `final` set).
    chain: SummaryChain | None = None
    part: int = 0

    @property
    def question(self) -> str:
        if isinstance(self.unit, SourceTask):
            return self.spec.summarize or ""
        return self.spec.turns(self.prompt_index)[self.turn]

    @property
    def last_turn(self) -> bool:
        return self.chain is not None or self.turn == len(self.spec.turns(self.prompt_index)) - 1


class RequestBuilder:
    def __init__(
        self, adapter: ModelAdapter, tokens: VisualTokenStore, *, model_name: str, engine_name: str
    ) -> None:
        self.adapter = adapter
        self.token_store = tokens
        self.model_name = model_name
        self.engine_name = engine_name
        self._text_tokens: dict[str, int] = {}

    def text_tokens(self, prompt: str) -> int:
        """Prompt tokens besides the image placeholders (template included)."""
        if prompt not in self._text_tokens:
            self._text_tokens[prompt] = len(self.adapter.prompt_ids(prompt, None))
        return self._text_tokens[prompt]

    def prepare(
        self, unit: UnitTask | WindowTask, spec: JobSpec, questions: Sequence[int | Question]
    ) -> list[Prepared]:
        """The unit (or window) asked each of these questions (a prompt's index: its first turn);
        its tokens read once for all of them."""
        asked = [q if isinstance(q, Question) else Question(q) for q in questions]
        try:
            images, cache_key = self._images(unit, spec)
        except _NotAsked as exc:
            return [Prepared(unit, spec, q.prompt_index, None, str(exc), q.turn) for q in asked]
        except Exception as exc:
            error = f"visual tokens unavailable: {type(exc).__name__}: {exc}"
            return [Prepared(unit, spec, q.prompt_index, None, error, q.turn) for q in asked]
        return [self._request(unit, spec, q, images, cache_key) for q in asked]

    def follow_up(self, prepared: Prepared, answer: str) -> Prepared:
        """The next turn of `prepared`'s conversation after its answer; the same images."""
        assert prepared.request is not None
        history = (*prepared.history, (prepared.question, answer))
        question = Question(prepared.prompt_index, prepared.turn + 1, history)
        return self._request(
            prepared.unit, prepared.spec, question, prepared.request.visual, prepared.request.cache_key
        )

    def _images(
        self, unit: UnitTask | WindowTask, spec: JobSpec
    ) -> tuple[VisualTokens | tuple[VisualTokens, ...], str]:
        """The unit's visual tokens (a window's: its units' in order) and their cache key."""
        shown = unit.units if isinstance(unit, WindowTask) else (unit,)
        if isinstance(unit, WindowTask) and unit.failed:
            raise _NotAsked("; ".join(unit.failed))
        if not shown:
            raise _NotAsked("every frame of the window repeats an earlier one (skipped as near-duplicates)")
        # Several images in one prompt: each on the family's window view where it has one
        # (encoded beside the usual view: worker.stages.encode.shows_window_view).
        window_view = len(shown) > 1 and self.adapter.has_window_view
        visual, keys = [], []
        for one in shown:
            # The resize bounds the unit was counted with at ingest (its job's budget); None: the model's.
            bounds = PixelBounds.of(one.min_pixels, one.max_pixels)
            if one.image_key is None:
                raise ValueError("the unit has no image")
            visual.append(self.token_store.for_policy(spec.cache).get(one.image_key, bounds, window_view))
            keys.append(self.token_store.cache_key(one.image_key, bounds, window_view))
        images = tuple(visual) if isinstance(unit, WindowTask) else visual[0]
        return images, "+".join(keys)

    def _request(
        self,
        unit: UnitTask | WindowTask,
        spec: JobSpec,
        question: Question,
        images: VisualTokens | tuple[VisualTokens, ...],
        cache_key: str,
    ) -> Prepared:
        text = spec.turns(question.prompt_index)[question.turn]
        p, turn, history = question.prompt_index, question.turn, question.history
        try:
            prompt_ids = self.adapter.prompt_ids(text, images, history)
        except ValueError as exc:  # this model cannot take this request (e.g. several images)
            return Prepared(unit, spec, p, None, f"cannot build the prompt: {exc}", turn, history)
        s = spec.sampling
        request = EngineRequest(
            prompt_ids=prompt_ids,
            visual=images,
            cache_key=cache_key,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            json_schema=spec.json_schema,
            prune_keep=spec.budget.prune_keep,
            merge_keep=spec.budget.merge_keep,
            drop_static=spec.budget.drop_static,
            prompt=text,
            history=history,
        )
        return Prepared(unit, spec, p, request, None, turn, history)

    def row(self, prepared: Prepared, outcome: Generation | None, latency_ms: float) -> ResultRow:
        """The result of one request: its answer (validated against the schema), or its error."""
        unit, spec, request = prepared.unit, prepared.spec, prepared.request
        prompt_tokens = (
            len(request.prompt_ids) - request.visual_tokens
            if request is not None
            else self.text_tokens(prepared.question)
        )
        common = dict(
            unit_id=unit.unit_id,
            prompt_index=prepared.prompt_index,
            turn=prepared.turn,
            prompt_tokens=prompt_tokens,
            # What the LM was given (a window's images on their window view, when the family
            # has one); a request never built: its units' tokens.
            visual_tokens=request.visual_tokens if request is not None else unit.visual_tokens or 0,
            model=self.model_name,
            engine=self.engine_name,
            cache_hit=bool(unit.cache_hit),
            latency_ms=latency_ms,
            **_covers(unit),
        )
        error = prepared.error
        if outcome is not None and outcome.error is not None:
            error = outcome.error  # the engine refused this request alone; the others ran
        if outcome is None or error is not None:
            return ResultRow(
                output=None, text=None, error=error, completion_tokens=0, finish_reason=None, **common
            )
        output = None
        text = without_nul(outcome.text)
        if spec.json_schema is not None and not isinstance(unit, SourceTask):  # a summary is text
            output, error = validate_output(text, spec.json_schema)
            output = without_nul(output)
            if error and outcome.finish_reason == "length":
                # Say what to change: a small or confused model can fill any budget with digits
                # of one number, which only a larger budget or a bounded schema stops.
                error += (
                    f" (cut off at max_new_tokens={spec.sampling.max_new_tokens}: raise --max-new-tokens, "
                    "or bound the schema with maxLength/maxItems)"
                )
        return ResultRow(
            output=output,
            text=text,
            error=error,
            completion_tokens=len(outcome.token_ids),
            finish_reason=outcome.finish_reason,
            pruned_tokens=outcome.pruned_tokens,
            merged_tokens=outcome.merged_tokens,
            **common,
        )


def _covers(unit: UnitTask | WindowTask | SourceTask) -> dict[str, Any]:
    """A row's scope and last unit: a window's units, a source's summary; a unit's (the default)."""
    if isinstance(unit, WindowTask):
        return {"scope": "window", "unit_to": unit.last}
    if isinstance(unit, SourceTask):
        return {"scope": "source", "unit_to": unit.last}
    return {}


class _NotAsked(Exception):
    """A window that cannot be asked: the message is its answer's error."""


def without_nul(value: Any) -> Any:
    """Model output with every NUL character replaced (U+FFFD): PostgreSQL's text and JSONB refuse
    NUL, and one such answer must not fail a whole batch of results."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    return value
