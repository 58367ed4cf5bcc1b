"""Every read and write of the job tables the pipeline does, one short transaction per call.

Rules that keep the counters on ``jobs`` right when tasks are retried or delivered twice:

* A counter only moves together with the row state change it counts, in the same transaction,
  and only when the state really changed (so calling anything twice counts once).
* Rows are locked before their state is read (``FOR UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE``
  on SQLite, see ``Database.session``), always in the order sources -> units (by id) -> jobs,
  so concurrent workers neither lose updates nor deadlock.
* Counters move with ``SET c = c + :delta``, never read-modify-write in Python.

``close_job`` recounts everything from the rows, so it is also the repair tool.
All SQL goes through SQLAlchemy with bound parameters.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar, cast

from sqlalchemy import (
    Row,
    Select,
    Table,
    bindparam,
    case,
    false,
    func,
    literal,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from storage.db import Database
from storage.models import (
    FINISHED_JOB_STATUSES,
    ClaimStatus,
    DropClaim,
    Job,
    JobStatus,
    Result,
    Source,
    SourceKind,
    SourceStatus,
    Unit,
    UnitStatus,
    UTCDateTime,
    new_job_id,
    utcnow,
)
from storage.rows import ResultRow, UnitRow, UnitTask

JOBS = cast(Table, Job.__table__)
SOURCES = cast(Table, Source.__table__)
UNITS = cast(Table, Unit.__table__)
RESULTS = cast(Table, Result.__table__)
DROP_CLAIMS = cast(Table, DropClaim.__table__)

MAX_ERRORS = 1000
MIN_PREFIX = 6
# Bounded IN lists: PostgreSQL takes at most 65535 parameters per statement, SQLite 32766.
IN_CHUNK = 1000

_UNFINISHED_UNITS = (UnitStatus.PENDING.value, UnitStatus.ENCODED.value)
_T = TypeVar("_T")


class NotFound(KeyError):
    def __str__(self) -> str:
        # KeyError would print the repr of its argument (quoted); a message reads better.
        return str(self.args[0]) if self.args else ""


class JobNotFound(NotFound):
    """No job with this id, or a prefix that is too short, malformed or ambiguous."""


class SourceNotFound(NotFound):
    pass


# ---------------------------------------------------------------------------------------------
# Helpers


def _chunks(items: Sequence[_T], size: int = IN_CHUNK) -> Iterator[Sequence[_T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _insert(db: Database, table: Table) -> Any:
    """The dialect's own INSERT, which knows ON CONFLICT."""
    name = db.engine.dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"visbatch supports SQLite and PostgreSQL, not {name}")


def _now_param() -> Any:
    # Typed so SQLite stores it in the same UTC text format as ORM-written timestamps.
    return literal(utcnow(), UTCDateTime())


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _job_status(status: str) -> str:
    try:
        return JobStatus(status).value
    except ValueError:
        raise ValueError(f"unknown job status {status!r}; one of {[s.value for s in JobStatus]}") from None


def _bump(session: Session, job_id: str, **deltas: int) -> None:
    """Add deltas to job counters atomically (no-op when all are zero)."""
    values = {name: JOBS.c[name] + delta for name, delta in deltas.items() if delta}
    if values:
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(**values))


def _require_job(session: Session, job_id: str) -> None:
    if session.scalar(select(JOBS.c.id).where(JOBS.c.id == job_id)) is None:
        raise JobNotFound(f"no job {job_id!r}")


def _resolve_job_id(session: Session, job_id: str) -> str:
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


def _lock_units(session: Session, unit_ids: Iterable[int]) -> list[Row[Any]]:
    """Current (id, job_id, status) of these units, locked, in id order."""
    ids = sorted(set(unit_ids))
    rows: list[Row[Any]] = []
    for chunk in _chunks(ids):
        stmt = (
            select(UNITS.c.id, UNITS.c.job_id, UNITS.c.status)
            .where(UNITS.c.id.in_(chunk))
            .order_by(UNITS.c.id)
            .with_for_update()
        )
        rows.extend(session.execute(stmt).all())
    return rows


def _lock_source(session: Session, source_id: int) -> Row[Any]:
    stmt = select(SOURCES.c.job_id, SOURCES.c.status).where(SOURCES.c.id == source_id).with_for_update()
    row = session.execute(stmt).one_or_none()
    if row is None:
        raise SourceNotFound(f"no source {source_id}")
    return row


def _count_down(session: Session, job_id: str, n: int) -> int:
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


# ---------------------------------------------------------------------------------------------
# Jobs


def create_job(db: Database, spec: Mapping[str, Any], status: str = JobStatus.QUEUED) -> str:
    """Insert a job and return its id. ``spec`` must be JSON (a pydantic model is dumped as JSON)."""
    dump = getattr(spec, "model_dump", None)
    payload = dump(mode="json") if callable(dump) else dict(spec)
    job_id = new_job_id()
    with db.session() as session:
        session.execute(JOBS.insert().values(id=job_id, spec=payload, status=_job_status(status)))
    return job_id


def set_job_status(db: Database, job_id: str, status: str, error: str | None = None) -> None:
    """Set the status (and error, when given). A finished status stamps finished_at once; an
    unfinished one (a resumed job) clears it."""
    status = _job_status(status)
    values: dict[str, Any] = {"status": status}
    if error is not None:
        values["error"] = error
    if status in FINISHED_JOB_STATUSES:
        values["finished_at"] = func.coalesce(JOBS.c.finished_at, _now_param())
    else:
        values["finished_at"] = None
    with db.session() as session:
        changed = session.execute(
            update(JOBS).where(JOBS.c.id == job_id).values(**values).returning(JOBS.c.id)
        )
        if changed.first() is None:
            raise JobNotFound(f"no job {job_id!r}")


# ---------------------------------------------------------------------------------------------
# Sources


def add_source(db: Database, job_id: str, uri: str) -> int:
    """Register a source for the job, once: a repeated call returns the existing id."""
    stmt = (
        _insert(db, SOURCES)
        .values(job_id=job_id, uri=uri, status=SourceStatus.PENDING.value, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=[SOURCES.c.job_id, SOURCES.c.uri])
        .returning(SOURCES.c.id)
    )
    with db.session() as session:
        _require_job(session, job_id)
        new_id = session.execute(stmt).scalar_one_or_none()
        if new_id is not None:
            _bump(session, job_id, sources_total=1)
            return int(new_id)
        existing = select(SOURCES.c.id).where(SOURCES.c.job_id == job_id, SOURCES.c.uri == uri)
        return int(session.execute(existing).scalar_one())


def _source_facts(kind: str | None, sha256: str | None, size: int | None) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    if kind is not None:
        facts["kind"] = SourceKind(kind).value
    if sha256 is not None:
        facts["sha256"] = sha256
    if size is not None:
        facts["bytes"] = size
    return facts


def mark_source_ingested(db: Database, source_id: int, *, kind: str, sha256: str, size: int) -> None:
    values = {"status": SourceStatus.INGESTED.value, "error": None, **_source_facts(kind, sha256, size)}
    with db.session() as session:
        before = _lock_source(session, source_id)
        session.execute(update(SOURCES).where(SOURCES.c.id == source_id).values(**values))
        if before.status == SourceStatus.FAILED:
            # A retried ingest that now works: the earlier failure no longer counts.
            _bump(session, before.job_id, sources_failed=-1)


def fail_source(
    db: Database,
    source_id: int,
    message: str,
    *,
    kind: str | None = None,
    sha256: str | None = None,
    size: int | None = None,
) -> None:
    """Mark a source failed; counts once however often it is called (the last message wins)."""
    values = {"status": SourceStatus.FAILED.value, "error": message, **_source_facts(kind, sha256, size)}
    with db.session() as session:
        before = _lock_source(session, source_id)
        session.execute(update(SOURCES).where(SOURCES.c.id == source_id).values(**values))
        if before.status != SourceStatus.FAILED:
            _bump(session, before.job_id, sources_failed=1)


# ---------------------------------------------------------------------------------------------
# Units

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


def add_units(db: Database, job_id: str, source_id: int, rows: Sequence[UnitRow]) -> list[int]:
    """Upsert a source's units on (source_id, index); returns their ids in the order of ``rows``.

    A row with ``error`` is stored failed. Units already encoded or done are left untouched, so
    a re-run ingest never throws away work; pending or failed ones take the new values.
    """
    if not rows:
        return []
    indexes = [row.index for row in rows]
    if len(set(indexes)) != len(indexes):
        raise ValueError("add_units: the same unit index appears twice in one call")
    with db.session() as session:
        source = _lock_source(session, source_id)
        if source.job_id != job_id:
            raise ValueError(f"source {source_id} belongs to job {source.job_id}, not {job_id}")
        before_stmt = select(UNITS.c.unit_index, UNITS.c.status, UNITS.c.visual_tokens).where(
            UNITS.c.source_id == source_id
        )
        before = {row.unit_index: row for row in session.execute(before_stmt)}

        stmt = _insert(db, UNITS)
        stmt = stmt.on_conflict_do_update(
            index_elements=[UNITS.c.source_id, UNITS.c.unit_index],
            set_={name: stmt.excluded[name] for name in _UNIT_DATA_COLUMNS},
            # Plain ORs: an IN list is an "expanding" parameter, which executemany cannot take.
            where=or_(*(UNITS.c.status == status for status in _REWRITABLE_UNIT_STATUSES)),
        )
        session.execute(stmt, [_unit_params(job_id, source_id, row) for row in rows])
        _bump(session, job_id, **_unit_deltas(before, rows))

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
        fresh = [row for row in _lock_units(session, wanted) if row.status == UnitStatus.PENDING]
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
            _bump(session, job_id, cache_hits=hits[job_id][0], cache_misses=hits[job_id][1])
    return len(fresh)


def fail_units(db: Database, items: Sequence[tuple[int, str]]) -> dict[str, int]:
    """(unit_id, message) -> status failed. Counts once per unit (the first message is kept).

    Returns {job_id: units_pending left} for every job whose countdown moved: a caller that sees 0
    there closes the job, exactly as with ``finish_units``.
    """
    messages = dict(items)
    if not messages:
        return {}
    remaining: dict[str, int] = {}
    with db.session() as session:
        changing = [row for row in _lock_units(session, messages) if row.status != UnitStatus.FAILED]
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
            unpended[row.job_id] += row.status in _UNFINISHED_UNITS
        for job_id in sorted(failed):
            _bump(session, job_id, units_failed=failed[job_id])
            if unpended[job_id]:
                remaining[job_id] = _count_down(session, job_id, unpended[job_id])
    return remaining


def finish_units(db: Database, job_id: str, unit_ids: Sequence[int]) -> int:
    """Mark units done and count the job down; returns the units still pending.

    Only units not yet done or failed change, so a retried call does not count twice and the
    call that takes the count to 0 is unique. A call that changes nothing returns the current
    count (a retry after the end sees 0 again; ``close_job`` is idempotent).
    """
    ids = sorted(set(unit_ids))
    with db.session() as session:
        changed = 0
        for chunk in _chunks(ids):
            stmt = (
                update(UNITS)
                .where(
                    UNITS.c.job_id == job_id,
                    UNITS.c.id.in_(chunk),
                    UNITS.c.status.in_(_UNFINISHED_UNITS),
                )
                .values(status=UnitStatus.DONE.value)
                .returning(UNITS.c.id)
            )
            changed += len(session.execute(stmt).all())
        if changed:
            return _count_down(session, job_id, changed)
        current = session.scalar(select(JOBS.c.units_pending).where(JOBS.c.id == job_id))
        if current is None:
            raise JobNotFound(f"no job {job_id!r}")
        return int(current)


# ---------------------------------------------------------------------------------------------
# Results

# On a retry everything but identity and created_at is replaced.
_RESULT_UPDATE_COLUMNS = (
    "output",
    "text",
    "error",
    "prompt_tokens",
    "visual_tokens",
    "completion_tokens",
    "finish_reason",
    "model",
    "engine",
    "cache_hit",
    "latency_ms",
    "pruned_tokens",
    "merged_tokens",
    "updated_at",
)


def upsert_results(db: Database, job_id: str, rows: Sequence[ResultRow]) -> int:
    """Write results in one bulk INSERT .. ON CONFLICT (unit_id, prompt_index) DO UPDATE.

    All rows must belong to ``job_id``. Returns the number of rows written.
    """
    now = utcnow()
    # Last one wins for a key repeated within the call: PostgreSQL refuses to update one row
    # twice in one statement if the driver ever batches the executemany into multi-VALUES.
    latest = {(row.unit_id, row.prompt_index): row for row in rows}
    if not latest:
        return 0
    params = [
        {
            "unit_id": row.unit_id,
            "job_id": job_id,
            "prompt_index": row.prompt_index,
            "output": row.output,
            "text": row.text,
            "error": row.error,
            "prompt_tokens": row.prompt_tokens,
            "visual_tokens": row.visual_tokens,
            "completion_tokens": row.completion_tokens,
            "finish_reason": row.finish_reason,
            "model": row.model,
            "engine": row.engine,
            "cache_hit": row.cache_hit,
            "latency_ms": row.latency_ms,
            "pruned_tokens": row.pruned_tokens,
            "merged_tokens": row.merged_tokens,
            "created_at": now,
            "updated_at": now,
        }
        for row in latest.values()
    ]
    stmt = _insert(db, RESULTS)
    stmt = stmt.on_conflict_do_update(
        index_elements=[RESULTS.c.unit_id, RESULTS.c.prompt_index],
        set_={name: stmt.excluded[name] for name in _RESULT_UPDATE_COLUMNS},
    )
    with db.session() as session:
        session.execute(stmt, params)
    return len(params)


# ---------------------------------------------------------------------------------------------
# Closing and reading


@dataclass(frozen=True, slots=True)
class _Tally:
    sources: dict[str, int]
    units: dict[str, int]
    visual_tokens: int
    cache_hits: int
    cache_misses: int
    results_total: int
    results_failed: int
    prompt_tokens: int
    completion_tokens: int


def _tally(session: Session, job_id: str) -> _Tally:
    """Everything close_job needs, counted from the rows (three aggregate queries)."""
    sources_stmt = (
        select(SOURCES.c.status, func.count()).where(SOURCES.c.job_id == job_id).group_by(SOURCES.c.status)
    )
    sources = {status: int(n) for status, n in session.execute(sources_stmt)}
    units_stmt = (
        select(
            UNITS.c.status,
            func.count(),
            func.coalesce(func.sum(UNITS.c.visual_tokens), 0),
            func.coalesce(func.sum(case((UNITS.c.cache_hit == true(), 1), else_=0)), 0),
            func.coalesce(func.sum(case((UNITS.c.cache_hit == false(), 1), else_=0)), 0),
        )
        .where(UNITS.c.job_id == job_id)
        .group_by(UNITS.c.status)
    )
    units: dict[str, int] = {}
    tokens = hits = misses = 0
    for status, n, status_tokens, status_hits, status_misses in session.execute(units_stmt):
        units[status] = int(n)
        tokens += int(status_tokens)
        hits += int(status_hits)
        misses += int(status_misses)
    total, failed, prompt, completion = _result_totals(session, job_id)
    return _Tally(sources, units, tokens, hits, misses, total, failed, prompt, completion)


def _result_totals(session: Session, job_id: str) -> tuple[int, int, int, int]:
    """(results, of which failed, prompt tokens, completion tokens) of a job."""
    stmt = select(
        func.count(),
        func.count(RESULTS.c.error),
        func.coalesce(func.sum(RESULTS.c.prompt_tokens), 0),
        func.coalesce(func.sum(RESULTS.c.completion_tokens), 0),
    ).where(RESULTS.c.job_id == job_id)
    total, failed, prompt, completion = session.execute(stmt).one()
    return int(total), int(failed), int(prompt), int(completion)


def _final_status(current: str, tally: _Tally) -> str:
    if current == JobStatus.CANCELLED:
        return current
    if tally.results_total - tally.results_failed == 0:
        return JobStatus.FAILED.value
    problems = (
        tally.sources.get(SourceStatus.FAILED, 0)
        + tally.sources.get(SourceStatus.PENDING, 0)  # never ingested
        + tally.units.get(UnitStatus.FAILED, 0)
        + sum(tally.units.get(status, 0) for status in _UNFINISHED_UNITS)  # closed early
        + tally.results_failed
    )
    return (JobStatus.PARTIAL if problems else JobStatus.SUCCEEDED).value


def close_job(db: Database, job_id: str) -> str:
    """Decide the final status from the rows, recount every counter, stamp finished_at (once).

    succeeded: nothing failed or unfinished; failed: not one result without error; partial:
    otherwise; a cancelled job stays cancelled. Idempotent.
    """
    with db.session() as session:
        lock = select(JOBS.c.status, JOBS.c.error).where(JOBS.c.id == job_id).with_for_update()
        job = session.execute(lock).one_or_none()
        if job is None:
            raise JobNotFound(f"no job {job_id!r}")
        tally = _tally(session, job_id)
        status = _final_status(job.status, tally)
        values: dict[str, Any] = {
            "status": status,
            "finished_at": func.coalesce(JOBS.c.finished_at, _now_param()),
            "sources_total": sum(tally.sources.values()),
            "sources_failed": tally.sources.get(SourceStatus.FAILED, 0),
            "units_total": sum(tally.units.values()),
            "units_failed": tally.units.get(UnitStatus.FAILED, 0),
            "units_pending": sum(tally.units.get(status, 0) for status in _UNFINISHED_UNITS),
            "results_total": tally.results_total,
            "results_failed": tally.results_failed,
            "cache_hits": tally.cache_hits,
            "cache_misses": tally.cache_misses,
            "visual_tokens": tally.visual_tokens,
            "prompt_tokens": tally.prompt_tokens,
            "completion_tokens": tally.completion_tokens,
        }
        if status == JobStatus.FAILED and job.error is None:
            values["error"] = (
                f"no successful result ({tally.sources.get(SourceStatus.FAILED, 0)} sources, "
                f"{tally.units.get(UnitStatus.FAILED, 0)} units and {tally.results_failed} results failed)"
            )
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(**values))
    return status


def resolve_job_id(db: Database, job_id: str) -> str:
    """The full id for a full id or a unique prefix (>= 6 hex digits), like git."""
    with db.session(readonly=True) as session:
        return _resolve_job_id(session, job_id)


def _errors_select(job_id: str) -> list[Select[Any]]:
    """Failed sources, failed units, failed results: (source, unit, prompt, message)."""
    failed_sources = (
        select(
            SOURCES.c.uri.label("source"),
            null().label("unit"),
            null().label("prompt"),
            SOURCES.c.error.label("message"),
        )
        .where(SOURCES.c.job_id == job_id, SOURCES.c.status == SourceStatus.FAILED.value)
        .order_by(SOURCES.c.uri)
    )
    failed_units = (
        select(
            SOURCES.c.uri.label("source"),
            UNITS.c.unit_index.label("unit"),
            null().label("prompt"),
            UNITS.c.error.label("message"),
        )
        .join_from(UNITS, SOURCES, UNITS.c.source_id == SOURCES.c.id)
        .where(UNITS.c.job_id == job_id, UNITS.c.status == UnitStatus.FAILED.value)
        .order_by(SOURCES.c.uri, UNITS.c.unit_index)
    )
    failed_results = (
        select(
            SOURCES.c.uri.label("source"),
            UNITS.c.unit_index.label("unit"),
            RESULTS.c.prompt_index.label("prompt"),
            RESULTS.c.error.label("message"),
        )
        .join_from(RESULTS, UNITS, RESULTS.c.unit_id == UNITS.c.id)
        .join(SOURCES, UNITS.c.source_id == SOURCES.c.id)
        .where(RESULTS.c.job_id == job_id, RESULTS.c.error.is_not(None))
        .order_by(SOURCES.c.uri, UNITS.c.unit_index, RESULTS.c.prompt_index)
    )
    return [failed_sources, failed_units, failed_results]


def _collect_errors(session: Session, job_id: str, cap: int) -> tuple[list[dict[str, Any]], bool]:
    errors: list[dict[str, Any]] = []
    for stmt in _errors_select(job_id):
        room = cap + 1 - len(errors)  # one extra row tells us whether we truncated
        if room <= 0:
            break
        for source, unit, prompt, message in session.execute(stmt.limit(room)):
            errors.append({"source": source, "unit": unit, "prompt": prompt, "message": message or ""})
    truncated = len(errors) > cap
    return errors[:cap], truncated


def job_summary(db: Database, job_id: str, *, max_errors: int = MAX_ERRORS) -> dict[str, Any]:
    """Status, counters and errors of a job (id or unique prefix).

    Result counts and token sums are counted live from the results table, so they are right
    while the job still runs; the other counters are maintained as work happens.
    """
    with db.session(readonly=True) as session:
        full_id = _resolve_job_id(session, job_id)
        job = session.execute(select(JOBS).where(JOBS.c.id == full_id)).one()
        results_total, results_failed, prompt_tokens, completion_tokens = _result_totals(session, full_id)
        errors, truncated = _collect_errors(session, full_id, max_errors)
        from storage.token_report import token_report  # beside the tables it reads

        tokens = token_report(session, full_id)
    return {
        "id": job.id,
        "status": job.status,
        "created_at": _iso(job.created_at),
        "updated_at": _iso(job.updated_at),
        "finished_at": _iso(job.finished_at),
        "spec": job.spec,
        "error": job.error,
        "sources_total": job.sources_total,
        "sources_failed": job.sources_failed,
        "units_total": job.units_total,
        "units_failed": job.units_failed,
        "units_pending": job.units_pending,
        "results": results_total - results_failed,
        "results_failed": results_failed,
        "cache_hits": job.cache_hits,
        "cache_misses": job.cache_misses,
        "visual_tokens": job.visual_tokens,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "tokens": tokens,
        "errors": errors,
        "errors_truncated": truncated,
    }


_RESULT_COLUMNS = (
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
)


def iter_results(db: Database, job_id: str, *, chunk_size: int = 1000) -> Iterator[dict[str, Any]]:
    """All results of a job (id or unique prefix) ordered by source uri, unit, prompt; streamed.

    The id is checked now (JobNotFound is raised here, not at the first ``next``); rows are then
    fetched ``chunk_size`` at a time (a server-side cursor on PostgreSQL).
    """
    full_id = resolve_job_id(db, job_id)
    return _stream_results(db, full_id, chunk_size)


def _stream_results(db: Database, job_id: str, chunk_size: int) -> Iterator[dict[str, Any]]:
    stmt = (
        select(*_RESULT_COLUMNS)
        .join_from(RESULTS, UNITS, RESULTS.c.unit_id == UNITS.c.id)
        .join(SOURCES, UNITS.c.source_id == SOURCES.c.id)
        .where(RESULTS.c.job_id == job_id)
        .order_by(SOURCES.c.uri, UNITS.c.unit_index, RESULTS.c.prompt_index)
        .execution_options(yield_per=chunk_size)
    )
    with db.session(readonly=True) as session:
        for row in session.execute(stmt):
            yield dict(row._mapping)


def list_jobs(db: Database, limit: int = 20) -> list[dict[str, Any]]:
    """The newest jobs first, with their counters."""
    stmt = select(JOBS).order_by(JOBS.c.created_at.desc(), JOBS.c.id).limit(limit)
    with db.session(readonly=True) as session:
        jobs = session.execute(stmt).all()
    return [
        {
            "id": job.id,
            "status": job.status,
            "created_at": _iso(job.created_at),
            "finished_at": _iso(job.finished_at),
            "sources_total": job.sources_total,
            "sources_failed": job.sources_failed,
            "units_total": job.units_total,
            "units_failed": job.units_failed,
            "units_pending": job.units_pending,
            "results_total": job.results_total,
            "results_failed": job.results_failed,
        }
        for job in jobs
    ]


def _units_in_state(db: Database, job_id: str, status: UnitStatus, limit: int | None) -> list[UnitTask]:
    stmt = (
        select(
            UNITS.c.id,
            UNITS.c.job_id,
            UNITS.c.source_id,
            SOURCES.c.uri,
            SOURCES.c.kind,
            UNITS.c.unit_index,
            UNITS.c.image_key,
            UNITS.c.visual_tokens,
            UNITS.c.width,
            UNITS.c.height,
            UNITS.c.cache_key,
            UNITS.c.cache_hit,
            UNITS.c.timestamp,
            UNITS.c.min_pixels,
            UNITS.c.max_pixels,
        )
        .join_from(UNITS, SOURCES, UNITS.c.source_id == SOURCES.c.id)
        .where(UNITS.c.job_id == job_id, UNITS.c.status == status.value)
        .order_by(SOURCES.c.uri, UNITS.c.unit_index)
        .limit(limit)
    )
    with db.session(readonly=True) as session:
        return [UnitTask(*row) for row in session.execute(stmt)]


def units_to_encode(db: Database, job_id: str, *, limit: int | None = None) -> list[UnitTask]:
    """Pending units of a job (not yet through the vision tower), by source uri and index."""
    return _units_in_state(db, job_id, UnitStatus.PENDING, limit)


def units_to_generate(db: Database, job_id: str, *, limit: int | None = None) -> list[UnitTask]:
    """Encoded units of a job (embeddings cached, no results yet), by source uri and index."""
    return _units_in_state(db, job_id, UnitStatus.ENCODED, limit)


# ---------------------------------------------------------------------------------------------
# Drop-folder claims


@dataclass(frozen=True, slots=True)
class ClaimRow:
    id: int
    bucket: str
    key: str
    etag: str
    job_id: str | None
    status: str
    error: str | None


def claim_object(db: Database, bucket: str, key: str, etag: str) -> int | None:
    """Claim an S3 object version (bucket, key, etag) for processing.

    Returns the new claim's id when THIS caller won it, None when it was claimed before (by any
    watcher, now or earlier). The unique constraint decides in one INSERT .. ON CONFLICT DO
    NOTHING RETURNING: a concurrent second insert waits for the first and then does nothing, so
    there is no check-then-act window (unlike a HEAD-then-PUT lock on S3).
    """
    now = utcnow()
    stmt = (
        _insert(db, DROP_CLAIMS)
        .values(
            bucket=bucket,
            key=key,
            etag=etag,
            status=ClaimStatus.CLAIMED.value,
            created_at=now,
            updated_at=now,
        )
        .on_conflict_do_nothing(index_elements=[DROP_CLAIMS.c.bucket, DROP_CLAIMS.c.key, DROP_CLAIMS.c.etag])
        .returning(DROP_CLAIMS.c.id)
    )
    with db.session() as session:
        claim_id = session.execute(stmt).scalar_one_or_none()
    return int(claim_id) if claim_id is not None else None


def set_claim(
    db: Database, claim_id: int, *, status: str, job_id: str | None = None, error: str | None = None
) -> None:
    """Move a claim to ``status``; ``job_id`` and ``error`` are written when given (else kept)."""
    values: dict[str, Any] = {"status": ClaimStatus(status).value, "updated_at": utcnow()}
    if job_id is not None:
        values["job_id"] = job_id
    if error is not None:
        values["error"] = error
    with db.session() as session:
        changed = session.execute(
            update(DROP_CLAIMS)
            .where(DROP_CLAIMS.c.id == claim_id)
            .values(**values)
            .returning(DROP_CLAIMS.c.id)
        )
        if changed.first() is None:
            raise NotFound(f"no drop claim {claim_id}")


def find_claim(db: Database, bucket: str, key: str, etag: str) -> ClaimRow | None:
    """The claim of this object version, if any."""
    stmt = select(
        DROP_CLAIMS.c.id,
        DROP_CLAIMS.c.bucket,
        DROP_CLAIMS.c.key,
        DROP_CLAIMS.c.etag,
        DROP_CLAIMS.c.job_id,
        DROP_CLAIMS.c.status,
        DROP_CLAIMS.c.error,
    ).where(DROP_CLAIMS.c.bucket == bucket, DROP_CLAIMS.c.key == key, DROP_CLAIMS.c.etag == etag)
    with db.session(readonly=True) as session:
        row = session.execute(stmt).one_or_none()
    return ClaimRow(*row) if row is not None else None
