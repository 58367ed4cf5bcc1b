"""Fan-in for the fleet: the database, not a Celery chord, decides who closes a job.

`jobs.units_pending` counts units not yet finished. In the fleet a source's units only appear
once a worker has ingested it, so a job whose first source is fully generated before the
second is ingested would reach 0 too early. Each source therefore holds the count up by one
from submission until its ingest completes; the worker whose update takes the count to 0
(units finished, sources released, or units failed) is the one that closes the job.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select, update

from storage.db import Database
from storage.models import SourceStatus, UnitStatus
from storage.repository import (
    JOBS,
    SOURCES,
    UNITS,
    UnitTask,
    _bump,
    _chunks,
    _count_down,
    _lock_source,
    _source_facts,
)


def hold_for_sources(db: Database, job_id: str, n_sources: int) -> None:
    """Called once at submission, after the sources are added and before any task is sent."""
    with db.session() as session:
        _bump(session, job_id, units_pending=n_sources)


def complete_source(
    db: Database,
    source_id: int,
    *,
    error: str | None = None,
    kind: str | None = None,
    sha256: str | None = None,
    size: int | None = None,
) -> int | None:
    """Mark a pending source ingested (or failed, with `error`) and release its hold.

    Returns the job's pending count after the release, or None when the source was already
    complete (a redelivered task): only the first completion counts down.
    """
    status = SourceStatus.FAILED if error else SourceStatus.INGESTED
    facts = _source_facts(kind, sha256, size)
    with db.session() as session:
        before = _lock_source(session, source_id)
        if before.status != SourceStatus.PENDING:
            return None
        session.execute(
            update(SOURCES).where(SOURCES.c.id == source_id).values(status=status.value, error=error, **facts)
        )
        if error:
            _bump(session, before.job_id, sources_failed=1)
        return _count_down(session, before.job_id, 1)



def job_state(db: Database, job_id: str) -> tuple[str, dict] | None:
    """(status, spec) of a job, or None when it does not exist (a task for a deleted job is dropped)."""
    with db.session(readonly=True) as session:
        row = session.execute(select(JOBS.c.status, JOBS.c.spec).where(JOBS.c.id == job_id)).one_or_none()
    return None if row is None else (row.status, row.spec)


def units_by_ids(db: Database, unit_ids: Sequence[int], status: UnitStatus) -> list[UnitTask]:
    """The units among `unit_ids` still in `status`: what a (possibly redelivered) task has left to do."""
    columns = (
        UNITS.c.id, UNITS.c.job_id, UNITS.c.source_id, SOURCES.c.uri, SOURCES.c.kind, UNITS.c.unit_index,
        UNITS.c.image_key, UNITS.c.visual_tokens, UNITS.c.width, UNITS.c.height, UNITS.c.cache_key,
        UNITS.c.cache_hit, UNITS.c.timestamp, UNITS.c.min_pixels, UNITS.c.max_pixels,
    )  # fmt: skip
    tasks: list[UnitTask] = []
    with db.session(readonly=True) as session:
        for chunk in _chunks(sorted(set(unit_ids))):
            stmt = (
                select(*columns)
                .join_from(UNITS, SOURCES, UNITS.c.source_id == SOURCES.c.id)
                .where(UNITS.c.id.in_(chunk), UNITS.c.status == status.value)
                .order_by(UNITS.c.id)
            )
            tasks.extend(UnitTask(*row) for row in session.execute(stmt))
    return tasks


def source_unit_ids(db: Database, source_id: int, status: UnitStatus) -> list[int]:
    with db.session(readonly=True) as session:
        stmt = select(UNITS.c.id).where(UNITS.c.source_id == source_id, UNITS.c.status == status.value)
        return list(session.scalars(stmt.order_by(UNITS.c.unit_index)))
