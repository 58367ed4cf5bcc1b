"""Sources: one input file or object of a job, and its hold on the job's countdown.

A source holds ``jobs.units_pending`` up by one from the moment it is added until its ingest
completes (``complete_source``): its units only appear while it is being split, so without the
hold a job whose first source is fully generated before the second is split would reach 0 and
close too early, in the fleet and in the streaming embedded run alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update

from storage.db import Database
from storage.models import SOURCES, UNITS, SourceKind, SourceStatus, UnitStatus, utcnow
from storage.sql import SourceNotFound, bump, count_down, dialect_insert, lock_source, require_job


@dataclass(frozen=True, slots=True)
class SourceState:
    id: int
    job_id: str
    uri: str
    status: str
    next_unit: int


def add_source(db: Database, job_id: str, uri: str) -> int:
    """Register a source for the job, once (a repeated call returns the existing id), with its hold."""
    stmt = (
        dialect_insert(db, SOURCES)
        .values(job_id=job_id, uri=uri, status=SourceStatus.PENDING.value, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=[SOURCES.c.job_id, SOURCES.c.uri])
        .returning(SOURCES.c.id)
    )
    with db.session() as session:
        require_job(session, job_id)
        new_id = session.execute(stmt).scalar_one_or_none()
        if new_id is not None:
            bump(session, job_id, sources_total=1, units_pending=1)
            return int(new_id)
        existing = select(SOURCES.c.id).where(SOURCES.c.job_id == job_id, SOURCES.c.uri == uri)
        return int(session.execute(existing).scalar_one())


def source_facts(kind: str | None, sha256: str | None, size: int | None) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    if kind is not None:
        facts["kind"] = SourceKind(kind).value
    if sha256 is not None:
        facts["sha256"] = sha256
    if size is not None:
        facts["bytes"] = size
    return facts


def complete_source(
    db: Database,
    source_id: int,
    *,
    error: str | None = None,
    kind: str | None = None,
    sha256: str | None = None,
    size: int | None = None,
) -> dict[str, int]:
    """Mark a pending source ingested (or failed, with `error`) and release its hold.

    Returns ``{job_id: units left}``, or ``{}`` when the source was already complete (a
    redelivered task): only the first completion counts down.
    """
    status = SourceStatus.FAILED if error else SourceStatus.INGESTED
    facts = source_facts(kind, sha256, size)
    with db.session() as session:
        before = lock_source(session, source_id)
        if before.status != SourceStatus.PENDING:
            return {}
        session.execute(
            update(SOURCES).where(SOURCES.c.id == source_id).values(status=status.value, error=error, **facts)
        )
        if error:
            bump(session, before.job_id, sources_failed=1)
        return {before.job_id: count_down(session, before.job_id, 1)}


def source_state(db: Database, source_id: int) -> SourceState:
    stmt = select(SOURCES.c.id, SOURCES.c.job_id, SOURCES.c.uri, SOURCES.c.status, SOURCES.c.next_unit)
    with db.session(readonly=True) as session:
        row = session.execute(stmt.where(SOURCES.c.id == source_id)).one_or_none()
    if row is None:
        raise SourceNotFound(f"no source {source_id}")
    return SourceState(*row)


def advance_cursor(db: Database, source_id: int, expected: int, new: int) -> bool:
    """Move a pending source's ingest cursor from `expected` to `new`; False when another delivery
    of the same range moved it first (that one hands the rest of the source on, not this one)."""
    stmt = (
        update(SOURCES)
        .where(
            SOURCES.c.id == source_id,
            SOURCES.c.next_unit == expected,
            SOURCES.c.status == SourceStatus.PENDING.value,
        )
        .values(next_unit=new)
        .returning(SOURCES.c.id)
    )
    with db.session() as session:
        return session.execute(stmt).first() is not None


def stored_unit_indexes(db: Database, source_id: int) -> set[int]:
    """Indexes of the source's units that need no new render (not failed): what a resumed ingest skips."""
    stmt = select(UNITS.c.unit_index).where(
        UNITS.c.source_id == source_id, UNITS.c.status != UnitStatus.FAILED.value
    )
    with db.session(readonly=True) as session:
        return set(session.scalars(stmt))


def count_sources(db: Database, job_id: str) -> int:
    """How many sources the job has (a resumed run's progress counts those done before it)."""
    stmt = select(func.count()).select_from(SOURCES).where(SOURCES.c.job_id == job_id)
    with db.session(readonly=True) as session:
        return int(session.scalar(stmt) or 0)


def pending_sources(db: Database, job_id: str) -> list[SourceState]:
    """The job's sources whose ingest has not completed, by uri."""
    stmt = (
        select(SOURCES.c.id, SOURCES.c.job_id, SOURCES.c.uri, SOURCES.c.status, SOURCES.c.next_unit)
        .where(SOURCES.c.job_id == job_id, SOURCES.c.status == SourceStatus.PENDING.value)
        .order_by(SOURCES.c.uri)
    )
    with db.session(readonly=True) as session:
        return [SourceState(*row) for row in session.execute(stmt)]
