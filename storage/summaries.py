"""A source's summary (`--summarize`): when a source's answers are all in, what they are, and its
units settled once the summary is stored.

In a job with a summary, a unit stays encoded once answered: its source's summary holds the
job's countdown (storage.sql) until it is stored, so a job never ends before its summaries. The
summary row is keyed by the source's first unit, scope `source`, its prompt index one past the
job's prompts (a row of its own beside the first page's answers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from storage.db import Database
from storage.models import RESULTS, SOURCES, UNITS, UnitStatus
from storage.rows import AnchoredTask, UnitTask
from storage.sql import RESULT_COLUMNS
from storage.units import TASK_COLUMNS, finish_units_in
from storage.windows import WindowRule, answer_counts, answered_windows, source_units


@dataclass(frozen=True, slots=True)
class SourceAnswer:
    """One answer of a source, for its summary: where it is, what it answers, what it says."""

    unit_from: int
    unit_to: int
    time_from: float | None
    time_to: float | None
    prompt_index: int
    turn: int
    text: str | None
    error: str | None


@dataclass(frozen=True, slots=True)
class SourceTask(AnchoredTask):
    """A source to summarize: its first unit (the row's key), its last unit's index, its answers."""

    answers: tuple[SourceAnswer, ...] = ()

    visual_tokens = 0
    cache_hit = False
    cache_key = None


def answered_sources(
    db: Database, sources: Sequence[tuple[int, WindowRule | None, int]], summary_index: int
) -> list[SourceTask]:
    """Of these (source, window rule or None, questions per unit or window), the sources whose
    answers are all in and that have no summary yet, with their answers."""
    tasks = []
    with db.session(readonly=True) as session:
        for source_id, rule, questions in sources:
            task = _answered(session, source_id, rule, questions, summary_index)
            if task is not None:
                tasks.append(task)
    return tasks


def _answered(
    session: Connection, source_id: int, rule: WindowRule | None, questions: int, summary_index: int
) -> SourceTask | None:
    complete, rows = source_units(session, source_id)
    if not complete or not rows:
        return None
    if any(row.status == UnitStatus.PENDING.value for row in rows):
        return None
    ids = [row.id for row in rows]
    if _has_summary(session, ids[0], summary_index):
        return None
    if rule is not None:
        if not answered_windows(session, rule, rows, questions):
            return None
    else:
        answered = answer_counts(session, ids, "unit")
        encoded = [row.id for row in rows if row.status == UnitStatus.ENCODED.value]
        if any(answered.get(unit_id, 0) < questions for unit_id in encoded):
            return None
    anchor = UnitTask(*rows[0][: len(TASK_COLUMNS)])
    return SourceTask(anchor, rows[-1].unit_index, tuple(_source_answers(session, source_id)))


def _has_summary(session: Connection, anchor_id: int, summary_index: int) -> bool:
    stmt = select(RESULTS.c.id).where(
        RESULTS.c.unit_id == anchor_id, RESULTS.c.prompt_index == summary_index, RESULTS.c.scope == "source"
    )
    return session.execute(stmt.limit(1)).first() is not None


def _source_answers(session: Connection, source_id: int) -> list[SourceAnswer]:
    """The source's answers (its summary's aside) as every reader selects them (RESULT_COLUMNS)."""
    stmt = (
        select(*RESULT_COLUMNS)
        .join_from(RESULTS, UNITS, RESULTS.c.unit_id == UNITS.c.id)
        .join(SOURCES, UNITS.c.source_id == SOURCES.c.id)
        .where(UNITS.c.source_id == source_id, RESULTS.c.scope != "source")
        .order_by(UNITS.c.unit_index, RESULTS.c.prompt_index, RESULTS.c.turn)
    )
    return [
        SourceAnswer(
            r.unit,
            r.unit if r.unit_to is None else r.unit_to,
            r.timestamp,
            r.timestamp_to,
            r.prompt_index,
            r.turn,
            r.text,
            r.error,
        )
        for r in session.execute(stmt)
    ]


def settle_summarized_in(session: Connection, source_ids: Sequence[int]) -> dict[str, int]:
    """Once a source's summary is stored: its units still encoded are done (in the caller's
    transaction); {job: units left} for the jobs moved."""
    ids: list[Any] = []
    for source_id in source_ids:
        stmt = select(UNITS.c.id).where(
            UNITS.c.source_id == source_id, UNITS.c.status == UnitStatus.ENCODED.value
        )
        ids += [int(i) for (i,) in session.execute(stmt)]
    return finish_units_in(session, ids) if ids else {}
