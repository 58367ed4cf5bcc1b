"""The SQL every storage module shares: table handles, the dialect's INSERT, row locks, counters,
the columns of a result record.

The rules that keep the counters on ``jobs`` right when tasks are retried or delivered twice
(storage.jobs, storage.sources, storage.units and storage.results all follow them):

* A counter only moves together with the row state change it counts, in the same transaction,
  and only when the state really changed (so calling anything twice counts once).
* Rows are locked before their state is read (``FOR UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE``
  on SQLite, see ``Database.session``), always in the order sources -> units (by id) -> jobs,
  so concurrent workers neither lose updates nor deadlock.
* Counters move with ``SET c = c + :delta``, never read-modify-write in Python.
* ``jobs.units_pending`` is the fan-in countdown: units not yet finished, plus one hold per
  source until its ingest completes. Every call that counts it down returns
  ``{job_id: units left}`` for the jobs it moved, and the caller that sees 0 closes the job
  (``storage.jobs.close_finished``).

All SQL goes through SQLAlchemy with bound parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, Row, Table, case, literal, select, update

from storage.db import Database
from storage.models import (
    JOBS,
    RESULTS,
    SOURCES,
    UNITS,
    JobStatus,
    UnitStatus,
    UTCDateTime,
    utcnow,
)

MAX_ERRORS = 1000
MIN_PREFIX = 6
# Bounded IN lists: PostgreSQL takes at most 65535 parameters per statement, SQLite 32766.
IN_CHUNK = 1000

# Units still to be worked on: they hold the job's countdown up.
UNFINISHED_UNITS = (UnitStatus.PENDING.value, UnitStatus.ENCODED.value)

# A result record as every reader selects it, from results joined to their units and sources
# (storage.results' iter_results and previews, storage.jobs' preview per source).
_WINDOW_END = UNITS.alias("window_end")
RESULT_COLUMNS = (
    SOURCES.c.uri.label("source"),
    SOURCES.c.kind.label("kind"),
    UNITS.c.unit_index.label("unit"),
    UNITS.c.timestamp.label("timestamp"),
    UNITS.c.width.label("width"),
    UNITS.c.height.label("height"),
    RESULTS.c.prompt_index.label("prompt_index"),
    RESULTS.c.output.label("output"),
    RESULTS.c.text.label("text"),
    RESULTS.c.error.label("error"),
    RESULTS.c.prompt_tokens.label("prompt_tokens"),
    RESULTS.c.visual_tokens.label("visual_tokens"),
    RESULTS.c.completion_tokens.label("completion_tokens"),
    RESULTS.c.finish_reason.label("finish_reason"),
    RESULTS.c.model.label("model"),
    RESULTS.c.engine.label("engine"),
    RESULTS.c.cache_hit.label("cache_hit"),
    RESULTS.c.latency_ms.label("latency_ms"),
    RESULTS.c.pruned_tokens.label("pruned_tokens"),
    RESULTS.c.merged_tokens.label("merged_tokens"),
    # What the answer covers (ingest.windows): a unit, or a window of units (unit .. unit_to),
    # and the turn; the time of a window's last frame, read only for a window's answer.
    RESULTS.c.scope.label("scope"),
    RESULTS.c.unit_to.label("unit_to"),
    RESULTS.c.turn.label("turn"),
    case(
        (RESULTS.c.unit_to.is_(None), UNITS.c.timestamp),
        else_=select(_WINDOW_END.c.timestamp)
        .where(_WINDOW_END.c.source_id == UNITS.c.source_id, _WINDOW_END.c.unit_index == RESULTS.c.unit_to)
        .scalar_subquery(),
    ).label("timestamp_to"),
)

_T = TypeVar("_T")


class NotFound(KeyError):
    def __str__(self) -> str:
        # KeyError would print the repr of its argument (quoted); a message reads better.
        return str(self.args[0]) if self.args else ""


class JobNotFound(NotFound):
    """No job with this id, or a prefix that is too short, malformed or ambiguous."""


class SourceNotFound(NotFound):
    pass


class SourceChanged(ValueError):
    """Units of a file other than the one the source's first units came from (storage.units)."""


def chunks(items: Sequence[_T], size: int = IN_CHUNK) -> Iterator[Sequence[_T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def dialect_insert(db: Database, table: Table) -> Any:
    """The dialect's own INSERT, which knows ON CONFLICT (imported here: the PostgreSQL dialect
    pulls in asyncio and more, which a SQLite `visbatch status` has no use for)."""
    from sqlalchemy.dialects import postgresql, sqlite

    name = db.engine.dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"visbatch supports SQLite and PostgreSQL, not {name}")


def now_param() -> Any:
    # Typed so SQLite stores it in the same UTC text format as ORM-written timestamps.
    return literal(utcnow(), UTCDateTime())


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def job_status_value(status: str) -> str:
    try:
        return JobStatus(status).value
    except ValueError:
        raise ValueError(f"unknown job status {status!r}; one of {[s.value for s in JobStatus]}") from None


def bump(session: Connection, job_id: str, **deltas: int) -> None:
    """Add deltas to job counters atomically (no-op when all are zero)."""
    values = {name: JOBS.c[name] + delta for name, delta in deltas.items() if delta}
    if values:
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(**values))


def require_job(session: Connection, job_id: str) -> None:
    if session.scalar(select(JOBS.c.id).where(JOBS.c.id == job_id)) is None:
        raise JobNotFound(f"no job {job_id!r}")


def resolve_in_session(session: Connection, job_id: str) -> str:
    if session.scalar(select(JOBS.c.id).where(JOBS.c.id == job_id)) is not None:
        return job_id
    prefix = job_id.strip().lower()
    if not re.fullmatch(rf"[0-9a-f]{{{MIN_PREFIX},32}}", prefix):
        raise JobNotFound(f"no job {job_id!r} (give the id or a prefix of at least {MIN_PREFIX} hex digits)")
    matches = session.scalars(select(JOBS.c.id).where(JOBS.c.id.startswith(prefix)).limit(2)).all()
    if not matches:
        raise JobNotFound(f"no job {job_id!r}")
    if len(matches) > 1:
        raise JobNotFound(f"job prefix {job_id!r} is ambiguous; give more digits")
    return matches[0]


def lock_units(session: Connection, unit_ids: Iterable[int]) -> list[Row[Any]]:
    """Current (id, job_id, status) of these units, locked, in id order."""
    ids = sorted(set(unit_ids))
    rows: list[Row[Any]] = []
    for chunk in chunks(ids):
        stmt = (
            select(UNITS.c.id, UNITS.c.job_id, UNITS.c.status)
            .where(UNITS.c.id.in_(chunk))
            .order_by(UNITS.c.id)
            .with_for_update()
        )
        rows.extend(session.execute(stmt).all())
    return rows


def lock_source(session: Connection, source_id: int) -> Row[Any]:
    stmt = (
        select(SOURCES.c.job_id, SOURCES.c.status, SOURCES.c.sha256)
        .where(SOURCES.c.id == source_id)
        .with_for_update()
    )
    row = session.execute(stmt).one_or_none()
    if row is None:
        raise SourceNotFound(f"no source {source_id}")
    return row


def count_down(session: Connection, job_id: str, n: int) -> int:
    """The fan-in step: the database, not the caller, says how many units are left."""
    stmt = (
        update(JOBS)
        .where(JOBS.c.id == job_id)
        .values(units_pending=JOBS.c.units_pending - n)
        .returning(JOBS.c.units_pending)
    )
    remaining = session.execute(stmt).scalar_one_or_none()
    if remaining is None:
        raise JobNotFound(f"no job {job_id!r}")
    return int(remaining)


def count_down_jobs(session: Connection, counts: dict[str, int]) -> dict[str, int]:
    """count_down for several jobs, in job-id order (the lock order); returns what is left of each."""
    return {job_id: count_down(session, job_id, n) for job_id, n in sorted(counts.items()) if n}
