"""The rows the pipeline moves between its stages and the database: plain dataclasses.

Kept apart from the SQL (storage.repository) so that what only builds or reads rows (the
splitting child, ingest, the planner) never imports SQLAlchemy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class UnitRow:
    """One page or frame as ingest produced it."""

    index: int
    width: int | None
    height: int | None
    image_key: str | None
    visual_tokens: int | None
    timestamp: float | None = None
    text: str | None = None
    error: str | None = None
    # The visual-token budget: resize bounds (None: the model's own), tokens at the model's own
    # bounds, and for a skipped video frame why and which kept frame it repeats.
    min_pixels: int | None = None
    max_pixels: int | None = None
    full_tokens: int | None = None
    skip_reason: str | None = None
    duplicate_of: int | None = None


@dataclass(frozen=True, slots=True)
class ResultRow:
    """One generation: a unit answered for one prompt."""

    unit_id: int
    prompt_index: int
    output: Any | None
    text: str | None
    error: str | None
    prompt_tokens: int
    visual_tokens: int
    completion_tokens: int
    finish_reason: str | None
    model: str
    engine: str
    cache_hit: bool
    latency_ms: float
    pruned_tokens: int = 0
    merged_tokens: int = 0
    # A window's answer (ingest.windows): unit_id is its first unit, unit_to its last unit's index.
    scope: str = "unit"
    unit_to: int | None = None
    turn: int = 0


@dataclass(frozen=True, slots=True)
class UnitTask:
    """What encode/generate need to (re)start work on a unit, without its text layer."""

    unit_id: int
    job_id: str
    source_id: int
    source_uri: str
    kind: str | None
    index: int
    image_key: str | None
    visual_tokens: int | None
    width: int | None
    height: int | None
    cache_key: str | None
    cache_hit: bool | None
    timestamp: float | None
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass(frozen=True, slots=True)
class AnchoredTask:
    """Work over several units of one source whose answers are keyed by its first unit
    (`anchor`), up to the unit index `last`: a window (`WindowTask`), a source's summary
    (storage.summaries.SourceTask)."""

    anchor: UnitTask
    last: int

    @property
    def unit_id(self) -> int:
        return self.anchor.unit_id

    @property
    def job_id(self) -> str:
        return self.anchor.job_id

    @property
    def source_id(self) -> int:
        return self.anchor.source_id


@dataclass(frozen=True, slots=True)
class WindowTask(AnchoredTask):
    """Consecutive units of one source asked in one prompt (ingest.windows). `units` are those
    shown, in order (a skipped frame repeats one shown already, and is left out); `failed` says
    which of its units could not be encoded and why (the window is not asked: its answer is
    that error)."""

    units: tuple[UnitTask, ...] = ()
    failed: tuple[str, ...] = ()

    @property
    def visual_tokens(self) -> int:
        return sum(u.visual_tokens or 0 for u in self.units)

    @property
    def cache_hit(self) -> bool:
        return bool(self.units) and all(u.cache_hit for u in self.units)

    @property
    def cache_key(self) -> None:
        # Cache policy `none` deletes a unit's entry once it is answered; a unit of a window may
        # be in the next window too, so its entry is left to the hot tier's short TTL.
        return None
