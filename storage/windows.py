"""Windows of units in the database: which are ready to ask, and which units they settle.

A window (ingest.windows) is ready once none of its units is still pending (each is encoded,
failed, or a skipped frame) and it cannot change any more (its source is split that far). Its
answers are result rows keyed by its first unit, scope `window`. A unit of a windowed job is
done once every window holding it has its answers (errors included: an answer that is an error
is stored and counted, as a unit's is); until then it stays encoded and holds its job's
countdown (storage.sql), so a job ends only once every window is answered.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, func, select

from storage.db import Database
from storage.models import RESULTS, SOURCES, UNITS, SourceStatus, UnitStatus
from storage.rows import UnitTask, WindowTask
from storage.sql import chunks
from storage.units import TASK_COLUMNS, finish_units_in

_UNIT_WORDS = {"pdf": "page", "video": "frame"}


class WindowRule(Protocol):
    """Which windows a source has, from its units' timestamps (ingest.windows.WindowPlan: the
    job's `--window`); `complete=False` while the source is still being split."""

    def windows(self, timestamps: Sequence[float | None], complete: bool = True) -> list[tuple[int, int]]: ...


def windows_containing(windows: Sequence[tuple[int, int]], indexes: set[int]) -> list[tuple[int, int]]:
    """The windows that hold at least one of these unit positions."""
    ordered = sorted(indexes)
    held = []
    for a, b in windows:
        i = bisect.bisect_left(ordered, a)  # the first position at or after the start ...
        if i < len(ordered) and ordered[i] <= b:  # ... is at or before the end
            held.append((a, b))
    return held


def source_units(session: Connection, source_id: int) -> tuple[bool, list[Any]]:
    """Whether the source is split to its end, and its units by index (task columns, status, error)."""
    status = session.execute(select(SOURCES.c.status).where(SOURCES.c.id == source_id)).scalar_one()
    stmt = (
        select(*TASK_COLUMNS, UNITS.c.status, UNITS.c.error)
        .join_from(UNITS, SOURCES, UNITS.c.source_id == SOURCES.c.id)
        .where(UNITS.c.source_id == source_id)
        .order_by(UNITS.c.unit_index)
    )
    return status != SourceStatus.PENDING.value, session.execute(stmt).all()


def _windows(plan: WindowRule, complete: bool, rows: Sequence[Any]) -> list[tuple[int, int]]:
    # Windows count positions in this list, not unit indexes: a page range (`--pages 3-5,9`)
    # keeps the pages' own numbers. While a source is being split its units are stored in order,
    # so the positions known so far do not change.
    return plan.windows([row.timestamp for row in rows], complete)


def ready_windows(db: Database, plan: WindowRule, unit_ids: Sequence[int]) -> list[WindowTask]:
    """The windows that hold any of these units and are ready to ask, in source and unit order."""
    tasks: list[WindowTask] = []
    with db.session(readonly=True) as session:
        by_source: dict[int, set[int]] = defaultdict(set)
        for chunk in chunks(sorted(set(unit_ids))):
            for source_id, unit_id in session.execute(
                select(UNITS.c.source_id, UNITS.c.id).where(UNITS.c.id.in_(chunk))
            ):
                by_source[int(source_id)].add(int(unit_id))
        for source_id, ids in sorted(by_source.items()):
            complete, rows = source_units(session, source_id)
            positions = {i for i, row in enumerate(rows) if row.id in ids}
            for first, last in windows_containing(_windows(plan, complete, rows), positions):
                members = rows[first : last + 1]
                if any(row.status == UnitStatus.PENDING.value for row in members):
                    continue
                tasks.append(_task(members))
    return tasks


def source_unit_ids(db: Database, source_id: int) -> list[int]:
    """Every unit of a source: once it is split to its end, its windows not yet asked are found
    from these (a window is known only then when a later unit, or the end, bounds it)."""
    with db.session(readonly=True) as session:
        stmt = select(UNITS.c.id).where(UNITS.c.source_id == source_id).order_by(UNITS.c.unit_index)
        return [int(i) for (i,) in session.execute(stmt)]


def _task(members: Sequence[Any]) -> WindowTask:
    def unit(row: Any) -> UnitTask:
        return UnitTask(*row[: len(TASK_COLUMNS)])

    shown = tuple(unit(r) for r in members if r.status in (UnitStatus.ENCODED.value, UnitStatus.DONE.value))
    failed = tuple(
        f"{_UNIT_WORDS.get(r.kind or '', 'unit')} {r.unit_index + 1} failed: {r.error or 'no reason given'}"
        for r in members
        if r.status == UnitStatus.FAILED.value
    )
    return WindowTask(unit(members[0]), members[-1].unit_index, shown, failed)


def answer_counts(session: Connection, unit_ids: Sequence[int], scope: str) -> dict[int, int]:
    """How many answers of `scope` (`unit`, `window`) each unit holds (a window's: its first unit)."""
    counts: dict[int, int] = {}
    for chunk in chunks(unit_ids):
        stmt = (
            select(RESULTS.c.unit_id, func.count())
            .where(RESULTS.c.unit_id.in_(chunk), RESULTS.c.scope == scope)
            .group_by(RESULTS.c.unit_id)
        )
        counts.update({int(u): int(n) for u, n in session.execute(stmt)})
    return counts


def _unanswered(session: Connection, plan: WindowRule, rows: Sequence[Any], questions: int) -> list[bool]:
    """Per unit position: whether it is in a window still without all its answers (one per
    prompt and turn: rows are unique on those)."""
    counts = answer_counts(session, [row.id for row in rows], "window")
    answered = {unit_id for unit_id, n in counts.items() if n >= questions}
    unanswered = [False] * len(rows)
    for first, last in _windows(plan, True, rows):
        if rows[first].id not in answered:
            for i in range(first, last + 1):
                unanswered[i] = True
    return unanswered


def answered_windows(session: Connection, plan: WindowRule, rows: Sequence[Any], questions: int) -> bool:
    """Whether every window of a source split to its end (its units: `rows`) has its answers."""
    return not any(_unanswered(session, plan, rows, questions))


def settle_windows_in(session: Connection, sources: Sequence[tuple[int, WindowRule, int]]) -> dict[str, int]:
    """Mark done every encoded unit of these (source, plan, questions) whose windows all have
    their answers, in the caller's transaction; returns {job: units left} for the jobs moved (the
    countdown: storage.sql). A source still being split waits: its last windows are not known."""
    finished: list[int] = []
    for source_id, plan, questions in sources:
        complete, rows = source_units(session, source_id)
        if not complete or not rows:
            continue
        unanswered = _unanswered(session, plan, rows, questions)
        encoded = UnitStatus.ENCODED.value
        finished += [row.id for i, row in enumerate(rows) if row.status == encoded and not unanswered[i]]
    return finish_units_in(session, finished) if finished else {}
