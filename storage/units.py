"""Units: the pages and frames of a source, and their way through encode and generate.

A unit is ``pending`` (stored, not yet through the tower), ``encoded`` (visual tokens cached),
``done`` (every prompt answered), ``failed`` or ``skipped`` (a near-duplicate video frame).
The counting rules are in storage.sql.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Row, bindparam, or_, select, update

from storage.db import Database
from storage.models import SOURCES, UNITS, UnitStatus
from storage.rows import UnitRow, UnitTask
from storage.sql import (
    UNFINISHED_UNITS,
    SourceChanged,
    bump,
    chunks,
    count_down_jobs,
    dialect_insert,
    lock_source,
    lock_units,
)

# Columns a re-ingest may overwrite (only while the unit has not been encoded yet).
_UNIT_DATA_COLUMNS = (
    "job_id",
    "timestamp",
    "width",
    "height",
    "image_key",
    "text",
    "visual_tokens",
    "cache_key",
    "cache_hit",
    "status",
    "error",
    "min_pixels",
    "max_pixels",
    "full_tokens",
    "skip_reason",
    "duplicate_of",
)
_REWRITABLE_UNIT_STATUSES = (UnitStatus.PENDING.value, UnitStatus.FAILED.value, UnitStatus.SKIPPED.value)


def _new_unit_status(row: UnitRow) -> UnitStatus:
    if row.error:
        return UnitStatus.FAILED
    return UnitStatus.SKIPPED if row.skip_reason else UnitStatus.PENDING


def _unit_params(job_id: str, source_id: int, row: UnitRow) -> dict[str, Any]:
    return {
        "source_id": source_id,
        "unit_index": row.index,
        "job_id": job_id,
        "timestamp": row.timestamp,
        "width": row.width,
        "height": row.height,
        "image_key": row.image_key,
        "text": row.text,
        "visual_tokens": row.visual_tokens,
        "cache_key": None,
        "cache_hit": None,
        "status": _new_unit_status(row).value,
        "error": row.error,
        "min_pixels": row.min_pixels,
        "max_pixels": row.max_pixels,
        "full_tokens": row.full_tokens,
        "skip_reason": row.skip_reason,
        "duplicate_of": row.duplicate_of,
    }


def _unit_deltas(before: Mapping[int, Row[Any]], rows: Sequence[UnitRow]) -> dict[str, int]:
    """Counter changes of an add_units call, from the rows' state before it."""
    deltas = {"units_total": 0, "units_failed": 0, "units_pending": 0, "visual_tokens": 0}
    for row in rows:
        old = before.get(row.index)
        old_status = old.status if old is not None else None
        if old_status not in (None, *_REWRITABLE_UNIT_STATUSES):
            continue  # already encoded or done: the upsert leaves it alone
        new_status = _new_unit_status(row)
        deltas["units_total"] += old is None
        deltas["units_failed"] += (new_status == UnitStatus.FAILED) - (old_status == UnitStatus.FAILED)
        deltas["units_pending"] += (new_status == UnitStatus.PENDING) - (old_status == UnitStatus.PENDING)
        old_tokens = (old.visual_tokens or 0) if old is not None else 0
        deltas["visual_tokens"] += (row.visual_tokens or 0) - old_tokens
    return deltas


def add_units(
    db: Database, job_id: str, source_id: int, rows: Sequence[UnitRow], *, sha256: str | None = None
) -> list[int]:
    """Upsert a source's units on (source_id, index); returns their ids in the order of ``rows``.

    A row with ``error`` is stored failed. Units already encoded or done are left untouched, so
    a re-run ingest never throws away work; pending or failed ones take the new values.
    ``sha256`` is the hash of the file the rows were rendered from: the first rows pin it on the
    source, and rows of another file (the object replaced between two page ranges) are refused
    with SourceChanged, never stored beside the first file's pages.
    """
    if not rows:
        return []
    indexes = [row.index for row in rows]
    if len(set(indexes)) != len(indexes):
        raise ValueError("add_units: the same unit index appears twice in one call")
    with db.session() as session:
        source = lock_source(session, source_id)
        if source.job_id != job_id:
            raise ValueError(f"source {source_id} belongs to job {source.job_id}, not {job_id}")
        if sha256 is not None and source.sha256 != sha256:
            if source.sha256 is not None:
                raise SourceChanged(
                    f"the file changed while it was being split (sha256 {source.sha256[:12]}... "
                    f"then {sha256[:12]}...): submit it again as a new job"
                )
            session.execute(update(SOURCES).where(SOURCES.c.id == source_id).values(sha256=sha256))
        before_stmt = select(UNITS.c.unit_index, UNITS.c.status, UNITS.c.visual_tokens).where(
            UNITS.c.source_id == source_id
        )
        before = {row.unit_index: row for row in session.execute(before_stmt)}

        stmt = dialect_insert(db, UNITS)
        stmt = stmt.on_conflict_do_update(
            index_elements=[UNITS.c.source_id, UNITS.c.unit_index],
            set_={name: stmt.excluded[name] for name in _UNIT_DATA_COLUMNS},
            # Plain ORs: an IN list is an "expanding" parameter, which executemany cannot take.
            where=or_(*(UNITS.c.status == status for status in _REWRITABLE_UNIT_STATUSES)),
        )
        session.execute(stmt, [_unit_params(job_id, source_id, row) for row in rows])
        bump(session, job_id, **_unit_deltas(before, rows))

        ids_stmt = select(UNITS.c.unit_index, UNITS.c.id).where(UNITS.c.source_id == source_id)
        ids = {index: unit_id for index, unit_id in session.execute(ids_stmt)}
    return [int(ids[index]) for index in indexes]


def mark_units_encoded(db: Database, items: Sequence[tuple[int, str, bool]]) -> int:
    """(unit_id, cache_key, cache_hit) -> status encoded. Only pending units change (and count as a
    cache hit or miss of their job); returns how many changed."""
    wanted = {unit_id: (cache_key, cache_hit) for unit_id, cache_key, cache_hit in items}
    if not wanted:
        return 0
    with db.session() as session:
        fresh = [row for row in lock_units(session, wanted) if row.status == UnitStatus.PENDING]
        if not fresh:
            return 0
        stmt = (
            update(UNITS)
            .where(UNITS.c.id == bindparam("b_id"))
            .values(
                status=UnitStatus.ENCODED.value, cache_key=bindparam("b_key"), cache_hit=bindparam("b_hit")
            )
        )
        params = [{"b_id": row.id, "b_key": wanted[row.id][0], "b_hit": wanted[row.id][1]} for row in fresh]
        session.execute(stmt, params)
        hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for row in fresh:
            hits[row.job_id][0 if wanted[row.id][1] else 1] += 1
        for job_id in sorted(hits):
            bump(session, job_id, cache_hits=hits[job_id][0], cache_misses=hits[job_id][1])
    return len(fresh)


def fail_units(db: Database, items: Sequence[tuple[int, str]]) -> dict[str, int]:
    """(unit_id, message) -> status failed. Counts once per unit (the first message is kept).

    Returns {job_id: units_pending left} for every job whose countdown moved: a caller that sees 0
    there closes the job, exactly as with ``finish_units``.
    """
    messages = dict(items)
    if not messages:
        return {}
    with db.session() as session:
        changing = [row for row in lock_units(session, messages) if row.status != UnitStatus.FAILED]
        if not changing:
            return {}
        stmt = (
            update(UNITS)
            .where(UNITS.c.id == bindparam("b_id"))
            .values(status=UnitStatus.FAILED.value, error=bindparam("b_error"))
        )
        session.execute(stmt, [{"b_id": row.id, "b_error": messages[row.id]} for row in changing])
        failed: dict[str, int] = defaultdict(int)
        unpended: dict[str, int] = defaultdict(int)
        for row in changing:
            failed[row.job_id] += 1
            # A unit already done had left the countdown; failing it later must not count twice.
            unpended[row.job_id] += row.status in UNFINISHED_UNITS
        for job_id in sorted(failed):
            bump(session, job_id, units_failed=failed[job_id])
        return count_down_jobs(session, unpended)


def finish_units(db: Database, unit_ids: Sequence[int]) -> dict[str, int]:
    """Mark units done (every prompt answered) and count their jobs down.

    Only units still pending or encoded change, so a retried call does not count twice and the
    call that takes a count to 0 is unique. Returns ``{job_id: units left}`` for the jobs moved.
    """
    with db.session() as session:
        return finish_units_in(session, unit_ids)


def finish_units_in(session: Any, unit_ids: Sequence[int]) -> dict[str, int]:
    """finish_units inside the caller's transaction (storage.results stores results with it)."""
    changing = [row for row in lock_units(session, unit_ids) if row.status in UNFINISHED_UNITS]
    if not changing:
        return {}
    for chunk in chunks([row.id for row in changing]):
        session.execute(update(UNITS).where(UNITS.c.id.in_(chunk)).values(status=UnitStatus.DONE.value))
    counts: dict[str, int] = defaultdict(int)
    for row in changing:
        counts[row.job_id] += 1
    return count_down_jobs(session, counts)


# What encode and generate need of a unit (UnitTask), in its field order.
TASK_COLUMNS = (
    UNITS.c.id, UNITS.c.job_id, UNITS.c.source_id, SOURCES.c.uri, SOURCES.c.kind, UNITS.c.unit_index,
    UNITS.c.image_key, UNITS.c.visual_tokens, UNITS.c.width, UNITS.c.height, UNITS.c.cache_key,
    UNITS.c.cache_hit, UNITS.c.timestamp, UNITS.c.min_pixels, UNITS.c.max_pixels,
)  # fmt: skip


def units_in_state(
    db: Database, job_id: str, status: UnitStatus, *, limit: int | None = None
) -> list[UnitTask]:
    """A job's units in `status`, by source uri and index (what a resumed job has left to do)."""
    stmt = (
        select(*TASK_COLUMNS)
        .join_from(UNITS, SOURCES, UNITS.c.source_id == SOURCES.c.id)
        .where(UNITS.c.job_id == job_id, UNITS.c.status == status.value)
        .order_by(SOURCES.c.uri, UNITS.c.unit_index)
        .limit(limit)
    )
    with db.session(readonly=True) as session:
        return [UnitTask(*row) for row in session.execute(stmt)]


def units_by_ids(db: Database, unit_ids: Sequence[int], status: UnitStatus) -> list[UnitTask]:
    """The units among `unit_ids` still in `status`: what a (possibly redelivered) task has left to do."""
    tasks: list[UnitTask] = []
    with db.session(readonly=True) as session:
        for chunk in chunks(sorted(set(unit_ids))):
            stmt = (
                select(*TASK_COLUMNS)
                .join_from(UNITS, SOURCES, UNITS.c.source_id == SOURCES.c.id)
                .where(UNITS.c.id.in_(chunk), UNITS.c.status == status.value)
                .order_by(UNITS.c.id)
            )
            tasks.extend(UnitTask(*row) for row in session.execute(stmt))
    return tasks
