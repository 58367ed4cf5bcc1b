"""Read-only queries behind the review site (`visbatch view`) and `visbatch compare`.

Everything here reads a page at a time (LIMIT/OFFSET on indexed columns, or a streamed cursor),
so a job of a million pages is browsed or compared without holding it in memory. All SQL is
built with SQLAlchemy Core and bound parameters; nothing here writes.

Filters ("views") of a source's units, shared by the counts and the pages so the two always agree:

* ``failed``  the unit failed (split, encode) or at least one of its answers has an error;
* ``schema``  at least one answer that the model produced but that failed JSON validation: the
  only results holding both ``text`` and ``error`` (``worker.generate`` keeps the raw text of a
  rejected JSON answer; an engine failure has no text);
* ``skipped`` a near-duplicate video frame, never asked (``units.skip_reason``, ``duplicate_of``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, Select, and_, case, exists, func, or_, select

from storage.db import Database
from storage.jobs import closed_report
from storage.models import JOBS, RESULTS, SOURCES, UNITS, UnitStatus
from storage.repository import resolve_job_id
from storage.token_report import token_report

VIEWS = ("all", "failed", "schema", "skipped")
_ENCODED = (UnitStatus.ENCODED.value, UnitStatus.DONE.value)


@dataclass(frozen=True)
class JobInfo:
    id: str
    status: str
    created_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any]
    error: str | None
    sources_total: int
    sources_failed: int
    units_total: int
    units_failed: int
    tokens: dict[str, Any]

    @property
    def prompts(self) -> list[str]:
        return list(self.spec.get("prompts") or [])

    @property
    def then(self) -> list[list[str]]:
        """Follow-up turns per prompt (`--then`)."""
        return list(self.spec.get("then") or [])


@dataclass(frozen=True)
class SourceSummary:
    id: int
    uri: str
    kind: str | None
    status: str
    error: str | None
    units: int = 0
    done: int = 0
    failed: int = 0
    skipped: int = 0
    visual_tokens: int = 0
    answers: int = 0
    answers_failed: int = 0
    schema_errors: int = 0
    completion_tokens: int = 0
    # Units each filter shows (see the module docstring).
    view_counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ResultView:
    prompt_index: int
    output: Any
    text: str | None
    error: str | None
    prompt_tokens: int
    visual_tokens: int
    completion_tokens: int
    pruned_tokens: int
    finish_reason: str | None
    cache_hit: bool
    latency_ms: float
    # What the answer covers (ingest.windows): a window's units, as (unit id, index, timestamp)
    # in order (empty for a unit's answer), and the turn (`--then`).
    scope: str = "unit"
    unit_to: int | None = None
    turn: int = 0
    window: tuple[tuple[int, int, float | None], ...] = ()

    @property
    def is_schema_error(self) -> bool:
        return self.error is not None and self.text is not None


@dataclass(frozen=True)
class UnitView:
    id: int
    index: int
    timestamp: float | None
    width: int | None
    height: int | None
    image_key: str | None
    status: str
    error: str | None
    visual_tokens: int | None
    full_tokens: int | None
    cache_hit: bool | None
    skip_reason: str | None
    duplicate_of: int | None
    results: list[ResultView] = field(default_factory=list)


def load_job(db: Database, job: str) -> JobInfo:
    """The job (id or unique prefix) with its token report; raises repository.JobNotFound."""
    job_id = resolve_job_id(db, job)
    with db.session(readonly=True) as session:
        row = session.execute(select(JOBS).where(JOBS.c.id == job_id)).one()
        # A finished job's report as close_job counted it (every review page shows it).
        tokens = closed_report(row) or token_report(session, job_id)
    return JobInfo(
        id=row.id,
        status=row.status,
        created_at=row.created_at,
        finished_at=row.finished_at,
        spec=dict(row.spec or {}),
        error=row.error,
        sources_total=row.sources_total,
        sources_failed=row.sources_failed,
        units_total=row.units_total,
        units_failed=row.units_failed,
        tokens=tokens,
    )


def job_spec(db: Database, job: str) -> tuple[str, dict[str, Any]]:
    """(full id, spec) of a job (id or unique prefix): the cheap lookup, no counting."""
    job_id = resolve_job_id(db, job)
    with db.session(readonly=True) as session:
        spec = session.scalar(select(JOBS.c.spec).where(JOBS.c.id == job_id))
    return job_id, dict(spec or {})


# ---------------------------------------------------------------------------------------------
# Filters


def _has_result(*conditions: ColumnElement[bool]) -> ColumnElement[bool]:
    return exists().where(RESULTS.c.unit_id == UNITS.c.id, *conditions)


def view_condition(view: str) -> ColumnElement[bool] | None:
    """The WHERE clause on ``units`` for one filter (None: every unit)."""
    if view == "all":
        return None
    if view == "failed":
        return or_(UNITS.c.status == UnitStatus.FAILED.value, _has_result(RESULTS.c.error.is_not(None)))
    if view == "schema":
        return _has_result(RESULTS.c.error.is_not(None), RESULTS.c.text.is_not(None))
    if view == "skipped":
        return UNITS.c.status == UnitStatus.SKIPPED.value
    raise ValueError(f"unknown view {view!r} (one of {', '.join(VIEWS)})")


def _flag(condition: ColumnElement[bool] | None) -> Any:
    return func.count() if condition is None else func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


# ---------------------------------------------------------------------------------------------
# Sources


def count_sources(db: Database, job_id: str) -> int:
    with db.session(readonly=True) as session:
        return int(session.scalar(select(func.count()).where(SOURCES.c.job_id == job_id)) or 0)


def _source_stats(session: Connection, source_ids: Sequence[int]) -> dict[int, dict[str, int]]:
    if not source_ids:
        return {}
    u = UNITS.c
    unit_stmt = (
        select(
            u.source_id,
            func.count().label("units"),
            _flag(u.status == UnitStatus.DONE.value).label("done"),
            _flag(u.status == UnitStatus.FAILED.value).label("failed"),
            _flag(u.status == UnitStatus.SKIPPED.value).label("skipped"),
            # As the job's spent visual tokens count them (storage.token_report): encoded ones.
            func.coalesce(
                func.sum(case((u.status.in_(_ENCODED), func.coalesce(u.visual_tokens, 0)))), 0
            ).label("visual_tokens"),
            *(_flag(view_condition(view)).label(f"view_{view}") for view in VIEWS if view != "all"),
        )
        .where(u.source_id.in_(source_ids))
        .group_by(u.source_id)
    )
    r = RESULTS.c
    result_stmt = (
        select(
            u.source_id,
            _flag(r.error.is_(None)).label("answers"),
            _flag(r.error.is_not(None)).label("answers_failed"),
            _flag(and_(r.error.is_not(None), r.text.is_not(None))).label("schema_errors"),
            func.coalesce(func.sum(r.completion_tokens), 0).label("completion_tokens"),
        )
        .join_from(RESULTS, UNITS, r.unit_id == u.id)
        .where(u.source_id.in_(source_ids))
        .group_by(u.source_id)
    )
    stats: dict[int, dict[str, int]] = {sid: {} for sid in source_ids}
    for row in session.execute(unit_stmt):
        values = dict(row._mapping)
        stats[values.pop("source_id")].update({k: int(v) for k, v in values.items()})
    for row in session.execute(result_stmt):
        values = dict(row._mapping)
        stats[values.pop("source_id")].update({k: int(v) for k, v in values.items()})
    return stats


def _summaries(session: Connection, rows: Sequence[Any]) -> list[SourceSummary]:
    stats = _source_stats(session, [row.id for row in rows])
    out = []
    for row in rows:
        s = stats.get(row.id, {})
        views = {view: s.pop(f"view_{view}", 0) for view in VIEWS if view != "all"}
        views["all"] = s.get("units", 0)
        out.append(
            SourceSummary(
                id=row.id,
                uri=row.uri,
                kind=row.kind,
                status=row.status,
                error=row.error,
                **s,
                view_counts=views,
            )
        )
    return out


def source_page(db: Database, job_id: str, *, offset: int, limit: int) -> list[SourceSummary]:
    """One page of the job's sources by uri, with their counts (two grouped queries per page)."""
    s = SOURCES.c
    stmt = (
        select(s.id, s.uri, s.kind, s.status, s.error)
        .where(s.job_id == job_id)
        .order_by(s.uri, s.id)
        .offset(offset)
        .limit(limit)
    )
    with db.session(readonly=True) as session:
        return _summaries(session, session.execute(stmt).all())


def get_source(db: Database, job_id: str, source_id: int) -> SourceSummary | None:
    s = SOURCES.c
    stmt = select(s.id, s.uri, s.kind, s.status, s.error).where(s.job_id == job_id, s.id == source_id)
    with db.session(readonly=True) as session:
        rows = session.execute(stmt).all()
        return _summaries(session, rows)[0] if rows else None


def source_ids(db: Database, job_id: str) -> Iterator[int]:
    """Every source id of the job in index order, streamed (for the static export)."""
    stmt = (
        select(SOURCES.c.id)
        .where(SOURCES.c.job_id == job_id)
        .order_by(SOURCES.c.uri, SOURCES.c.id)
        .execution_options(yield_per=1000)
    )
    with db.session(readonly=True) as session:
        yield from session.scalars(stmt)


# ---------------------------------------------------------------------------------------------
# Units


def _units_select(job_id: str, source_id: int, view: str) -> Select[Any]:
    stmt = select(UNITS).where(UNITS.c.job_id == job_id, UNITS.c.source_id == source_id)
    condition = view_condition(view)
    return stmt if condition is None else stmt.where(condition)


def count_units(db: Database, job_id: str, source_id: int, view: str) -> int:
    stmt = select(func.count()).select_from(_units_select(job_id, source_id, view).subquery())
    with db.session(readonly=True) as session:
        return int(session.scalar(stmt) or 0)


def unit_page(
    db: Database, job_id: str, source_id: int, view: str, *, offset: int, limit: int
) -> list[UnitView]:
    """One page of a source's units (by index) that pass ``view``, each with its answers."""
    stmt = _units_select(job_id, source_id, view).order_by(UNITS.c.unit_index).offset(offset).limit(limit)
    with db.session(readonly=True) as session:
        units = [
            UnitView(
                id=row.id,
                index=row.unit_index,
                timestamp=row.timestamp,
                width=row.width,
                height=row.height,
                image_key=row.image_key,
                status=row.status,
                error=row.error,
                visual_tokens=row.visual_tokens,
                full_tokens=row.full_tokens,
                cache_hit=row.cache_hit,
                skip_reason=row.skip_reason,
                duplicate_of=row.duplicate_of,
            )
            for row in session.execute(stmt)
        ]
        if not units:
            return []
        by_id = {unit.id: unit for unit in units}
        r = RESULTS.c
        results = select(
            r.unit_id,
            r.prompt_index,
            r.output,
            r.text,
            r.error,
            r.prompt_tokens,
            r.visual_tokens,
            r.completion_tokens,
            r.pruned_tokens,
            r.finish_reason,
            r.cache_hit,
            r.latency_ms,
            r.scope,
            r.unit_to,
            r.turn,
        ).where(r.unit_id.in_(list(by_id)))
        rows = [
            dict(row._mapping) for row in session.execute(results.order_by(r.unit_id, r.prompt_index, r.turn))
        ]
        # A window's units (its strip of pages or frames): one query for the whole page.
        last = max((row["unit_to"] for row in rows if row["unit_to"] is not None), default=None)
        members: dict[int, tuple[int, int, float | None]] = {}
        if last is not None:
            first = min(unit.index for unit in units)
            span = select(UNITS.c.id, UNITS.c.unit_index, UNITS.c.timestamp).where(
                UNITS.c.source_id == source_id, UNITS.c.unit_index.between(first, last)
            )
            members = {int(i): (int(u), int(i), t) for u, i, t in session.execute(span)}
        for values in rows:
            unit = by_id[values.pop("unit_id")]
            if values["unit_to"] is not None:
                span_of = range(unit.index, values["unit_to"] + 1)
                values["window"] = tuple(members[i] for i in span_of if i in members)
            unit.results.append(ResultView(**values))
    return units


def unit_position(db: Database, source_id: int, unit_index: int) -> int:
    """How many of the source's units come before ``unit_index`` (which page of "all" holds it)."""
    stmt = select(func.count()).where(UNITS.c.source_id == source_id, UNITS.c.unit_index < unit_index)
    with db.session(readonly=True) as session:
        return int(session.scalar(stmt) or 0)


def unit_image_key(db: Database, job_id: str, unit_id: int) -> str | None:
    """The stored image of one of the job's units (None: no such unit in this job, or no image).

    Looked up by primary key AND job, so the site can only ever serve this job's images.
    """
    stmt = select(UNITS.c.image_key).where(UNITS.c.id == unit_id, UNITS.c.job_id == job_id)
    with db.session(readonly=True) as session:
        return session.scalar(stmt)


# ---------------------------------------------------------------------------------------------
# Two jobs side by side (visbatch compare)


def job_sources(db: Database, job_id: str) -> tuple[int, list[str]]:
    """How many sources the job has, and a few of their uris (for error messages)."""
    with db.session(readonly=True) as session:
        n = int(session.scalar(select(func.count()).where(SOURCES.c.job_id == job_id)) or 0)
        sample = session.scalars(
            select(SOURCES.c.uri).where(SOURCES.c.job_id == job_id).order_by(SOURCES.c.uri).limit(3)
        ).all()
    return n, list(sample)


def shared_sources(db: Database, job_a: str, job_b: str) -> int:
    """Sources (by uri) present in both jobs."""
    sa, sb = SOURCES.alias(), SOURCES.alias()
    stmt = (
        select(func.count())
        .select_from(sa)
        .join(sb, and_(sb.c.uri == sa.c.uri, sb.c.job_id == job_b))
        .where(sa.c.job_id == job_a)
    )
    with db.session(readonly=True) as session:
        return int(session.scalar(stmt) or 0)


def unmatched_units(db: Database, job_a: str, job_b: str) -> int:
    """Units of ``job_a`` with no unit of the same source uri and index in ``job_b``."""
    ua, sa, ub, sb = UNITS.alias(), SOURCES.alias(), UNITS.alias(), SOURCES.alias()
    twin = (
        select(ub.c.id)
        .join(sb, sb.c.id == ub.c.source_id)
        .where(sb.c.job_id == job_b, sb.c.uri == sa.c.uri, ub.c.unit_index == ua.c.unit_index)
        .exists()
    )
    stmt = (
        select(func.count())
        .select_from(ua)
        .join(sa, sa.c.id == ua.c.source_id)
        .where(ua.c.job_id == job_a, ~twin)
    )
    with db.session(readonly=True) as session:
        return int(session.scalar(stmt) or 0)


def matched_visual_tokens(db: Database, job_a: str, job_b: str) -> tuple[int, int]:
    """Visual tokens each job spent on the units the two share (skipped frames spend none)."""
    ua, sa, ub, sb = UNITS.alias(), SOURCES.alias(), UNITS.alias(), SOURCES.alias()

    def spent(unit: Any) -> Any:
        skipped = unit.c.status == UnitStatus.SKIPPED.value
        return func.coalesce(func.sum(case((skipped, 0), else_=func.coalesce(unit.c.visual_tokens, 0))), 0)

    stmt = (
        select(spent(ua), spent(ub))
        .select_from(ua)
        .join(sa, sa.c.id == ua.c.source_id)
        .join(sb, and_(sb.c.uri == sa.c.uri, sb.c.job_id == job_b))
        .join(ub, and_(ub.c.source_id == sb.c.id, ub.c.unit_index == ua.c.unit_index))
        .where(sa.c.job_id == job_a)
    )
    with db.session(readonly=True) as session:
        a, b = session.execute(stmt).one()
    return int(a), int(b)


@dataclass(frozen=True)
class UnitPair:
    """A page or frame in both jobs: same source uri, same unit index."""

    uri: str
    kind: str | None
    unit_index: int
    timestamp: float | None
    unit_a: int
    unit_b: int
    status_a: str
    status_b: str
    image_a: str | None
    image_b: str | None


@dataclass(frozen=True)
class Answer:
    output: Any
    text: str | None
    error: str | None


# An answer's place among a unit's: its prompt, its turn (`--then`) and, for a window's answer
# keyed by this unit, the window's last unit (None for the unit's own answer).
AnswerKey = tuple[int, int, int | None]


def iter_unit_pairs(
    db: Database, job_a: str, job_b: str, *, chunk_size: int = 500
) -> Iterator[tuple[UnitPair, dict[AnswerKey, Answer], dict[AnswerKey, Answer]]]:
    """Every unit the jobs share, with each job's answers by prompt index, in (uri, index) order.

    The pairs stream from one query matched by the database on its unique indexes (sources
    (job, uri), units (source, index)); each chunk's answers come from one IN query on results.
    """
    ua, sa, ub, sb = UNITS.alias(), SOURCES.alias(), UNITS.alias(), SOURCES.alias()
    pairs = (
        select(
            sa.c.uri,
            sa.c.kind,
            ua.c.unit_index,
            ua.c.timestamp,
            ua.c.id.label("unit_a"),
            ub.c.id.label("unit_b"),
            ua.c.status.label("status_a"),
            ub.c.status.label("status_b"),
            ua.c.image_key.label("image_a"),
            ub.c.image_key.label("image_b"),
        )
        .select_from(ua)
        .join(sa, sa.c.id == ua.c.source_id)
        .join(sb, and_(sb.c.uri == sa.c.uri, sb.c.job_id == job_b))
        .join(ub, and_(ub.c.source_id == sb.c.id, ub.c.unit_index == ua.c.unit_index))
        .where(sa.c.job_id == job_a)
        .order_by(sa.c.uri, ua.c.unit_index)
        .execution_options(yield_per=chunk_size)
    )
    r = RESULTS.c
    with db.session(readonly=True) as session:
        for rows in session.execute(pairs).partitions():
            chunk = [UnitPair(**row._mapping) for row in rows]
            ids = [p.unit_a for p in chunk] + [p.unit_b for p in chunk]
            answers: dict[int, dict[AnswerKey, Answer]] = {}
            stmt = select(r.unit_id, r.prompt_index, r.turn, r.unit_to, r.output, r.text, r.error).where(
                r.unit_id.in_(ids), r.scope != "source"
            )
            for unit_id, prompt_index, turn, unit_to, output, text, error in session.execute(stmt):
                answers.setdefault(unit_id, {})[prompt_index, turn, unit_to] = Answer(output, text, error)
            for pair in chunk:
                yield pair, answers.get(pair.unit_a, {}), answers.get(pair.unit_b, {})
