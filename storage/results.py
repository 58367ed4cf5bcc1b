"""Results: one row per unit (or window) x prompt x turn, upserted so that a retry never duplicates one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select, update

from storage.db import Database
from storage.jobs import finished_among_in
from storage.models import JOBS, RESULTS, SOURCES, UNITS, utcnow
from storage.rows import ResultRow
from storage.sql import RESULT_COLUMNS, chunks, dialect_insert, now_param, resolve_in_session
from storage.summaries import settle_summarized_in
from storage.units import finish_units_in
from storage.windows import WindowRule, settle_windows_in

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
    "scope",
    "unit_to",
    "turn",
    "updated_at",
)


def _params(job_id: str, row: ResultRow, now: Any) -> dict[str, Any]:
    return {
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
        "scope": row.scope,
        "unit_to": row.unit_to,
        "turn": row.turn,
        "created_at": now,
        "updated_at": now,
    }


def _upsert(db: Database, session: Connection, rows: Sequence[tuple[str, ResultRow]]) -> set[str]:
    """Upsert the rows; returns the ids of the jobs they belong to."""
    now = utcnow()
    # Last one wins for a key repeated within the call: PostgreSQL refuses to update one row
    # twice in one statement if the driver ever batches the executemany into multi-VALUES.
    latest = {(row.unit_id, row.prompt_index, row.turn): (job_id, row) for job_id, row in rows}
    if not latest:
        return set()
    stmt = dialect_insert(db, RESULTS)
    stmt = stmt.on_conflict_do_update(
        index_elements=[RESULTS.c.unit_id, RESULTS.c.prompt_index, RESULTS.c.turn],
        set_={name: stmt.excluded[name] for name in _RESULT_UPDATE_COLUMNS},
    )
    session.execute(stmt, [_params(job_id, row, now) for job_id, row in latest.values()])
    return {job_id for job_id, _ in latest.values()}


def _stamp_first_result(session: Connection, job_ids: set[str]) -> None:
    # The first stored result of a job is its time to first result (streaming's measure). Jobs
    # are locked last (the lock order: sources -> units -> jobs).
    for job_id in sorted(job_ids):
        session.execute(
            update(JOBS)
            .where(JOBS.c.id == job_id, JOBS.c.first_result_at.is_(None))
            .values(first_result_at=now_param())
        )


def upsert_results(db: Database, job_id: str, rows: Sequence[ResultRow]) -> int:
    """Write results in one bulk INSERT .. ON CONFLICT (unit_id, prompt_index, turn) DO UPDATE.

    All rows must belong to ``job_id``. Returns the number of rows written.
    """
    with db.session() as session:
        jobs = _upsert(db, session, [(job_id, row) for row in rows])
        _stamp_first_result(session, jobs)
    return len({(row.unit_id, row.prompt_index, row.turn) for row in rows})


@dataclass(frozen=True)
class StoredResults:
    remaining: dict[str, int]  # job -> units left, for the jobs moved (finish_units)
    refused: set[str]  # jobs found finished (a cancel above all): nothing of theirs was stored


def store_results(
    db: Database,
    rows: Sequence[tuple[str, ResultRow]],
    finished_units: Sequence[tuple[str, int]] = (),
    windows: Mapping[tuple[str, int], tuple[WindowRule | None, int]] | None = None,
    summarized: Sequence[tuple[str, int]] = (),
) -> StoredResults:
    """Upsert (job_id, result) pairs and mark `finished_units` ((job_id, unit_id) pairs) done, in
    one transaction, so a crash never leaves a unit done without its results. `windows`: the
    (job_id, source_id) of windows answered here, with the job's window plan and question count:
    their units whose windows all have answers are marked done too (storage.windows).
    `summarized`: the (job_id, source_id) of source summaries stored here: their units are done.

    The jobs' states are read first, in the same transaction: once `visbatch cancel` (or anything
    that finishes a job) has committed, no result of that job is stored, whatever the engine had
    already answered. On SQLite the writer holds the file's write lock from BEGIN, so this is exact;
    on PostgreSQL (read committed, no row lock: taking one here would deadlock two flushes that
    both later update the same job row) a cancel that commits during this very transaction is
    seen by the next one.
    """
    with db.session() as session:
        refused = finished_among_in(session, [job_id for job_id, _ in [*rows, *finished_units]])
        jobs = _upsert(db, session, [(job_id, row) for job_id, row in rows if job_id not in refused])
        remaining = finish_units_in(session, [u for job_id, u in finished_units if job_id not in refused])
        settle = [
            (source_id, plan, prompts)
            for (job_id, source_id), (plan, prompts) in (windows or {}).items()
            if job_id not in refused and plan is not None
        ]
        if settle:
            remaining.update(settle_windows_in(session, settle))
        # A source's summary stored: its units are done (storage.summaries).
        done = [source_id for job_id, source_id in summarized if job_id not in refused]
        if done:
            remaining.update(settle_summarized_in(session, done))
        _stamp_first_result(session, jobs)
    return StoredResults(remaining, refused)


def answered_questions(db: Database, unit_ids: Sequence[int]) -> dict[int, dict[tuple[int, int], str]]:
    """The good answers each unit (or window: its first unit) has already, by (prompt index,
    turn), with their text (a follow-up turn is asked after them); errors excluded: a resumed
    job asks those again."""
    answered: dict[int, dict[tuple[int, int], str]] = defaultdict(dict)
    with db.session(readonly=True) as session:
        for chunk in chunks(sorted(set(unit_ids))):
            stmt = select(RESULTS.c.unit_id, RESULTS.c.prompt_index, RESULTS.c.turn, RESULTS.c.text).where(
                RESULTS.c.unit_id.in_(chunk), RESULTS.c.error.is_(None)
            )
            for unit_id, prompt_index, turn, text in session.execute(stmt):
                answered[int(unit_id)][int(prompt_index), int(turn)] = text or ""
    return answered


# Sources per query of iter_results: small enough that each query starts streaming at once.
SOURCES_PER_QUERY = 100


def iter_results(db: Database, job_id: str, *, chunk_size: int = 1000) -> Iterator[dict[str, Any]]:
    """All results of a job (id or unique prefix) ordered by source uri, unit, prompt; streamed.

    The id is checked now (JobNotFound is raised here, not at the first ``next``); rows are then
    fetched ``chunk_size`` at a time (a server-side cursor on PostgreSQL).
    """
    with db.session(readonly=True) as session:
        full_id = resolve_in_session(session, job_id)
    return _stream_results(db, full_id, chunk_size)


def _stream_results(db: Database, job_id: str, chunk_size: int) -> Iterator[dict[str, Any]]:
    """The job's sources a few at a time (by uri, from the (job_id, uri) index), and each batch's
    results in order from the units' and results' unique indexes.

    One query over the whole job would make PostgreSQL sort all its results before the first row
    (at 10 million rows: minutes, and gigabytes of temporary files; docs/scale.md); batches of
    sources keep every query small and the order the same.
    """
    after: str | None = None
    with db.session(readonly=True) as session:
        while True:
            sources = select(SOURCES.c.id, SOURCES.c.uri).where(SOURCES.c.job_id == job_id)
            if after is not None:
                sources = sources.where(SOURCES.c.uri > after)
            batch = session.execute(sources.order_by(SOURCES.c.uri).limit(SOURCES_PER_QUERY)).all()
            if not batch:
                return
            after = batch[-1].uri
            stmt = (
                select(*RESULT_COLUMNS)
                .join_from(RESULTS, UNITS, RESULTS.c.unit_id == UNITS.c.id)
                .join(SOURCES, UNITS.c.source_id == SOURCES.c.id)
                .where(UNITS.c.source_id.in_([row.id for row in batch]), RESULTS.c.job_id == job_id)
                .order_by(SOURCES.c.uri, UNITS.c.unit_index, RESULTS.c.prompt_index)
                .execution_options(yield_per=chunk_size)
            )
            for row in session.execute(stmt):
                yield dict(row._mapping)


def preview_results(db: Database, job_id: str, per_prompt: int = 3) -> dict[int, list[dict[str, Any]]]:
    """The first good answers of each prompt (by source uri, then unit), for the end of `visbatch run`:
    ``{prompt_index: [result record (as iter_results), ...]}``; one small query per prompt."""
    with db.session(readonly=True) as session:
        full_id = resolve_in_session(session, job_id)
        indexes = [
            int(i)
            for (i,) in session.execute(
                select(RESULTS.c.prompt_index)
                .where(RESULTS.c.job_id == full_id)
                .group_by(RESULTS.c.prompt_index)
                .order_by(RESULTS.c.prompt_index)
            )
        ]
        preview: dict[int, list[dict[str, Any]]] = {}
        for index in indexes:
            stmt = (
                select(*RESULT_COLUMNS)
                .join_from(RESULTS, UNITS, RESULTS.c.unit_id == UNITS.c.id)
                .join(SOURCES, UNITS.c.source_id == SOURCES.c.id)
                .where(
                    RESULTS.c.job_id == full_id, RESULTS.c.prompt_index == index, RESULTS.c.error.is_(None)
                )
                .order_by(SOURCES.c.uri, UNITS.c.unit_index)
                .limit(per_prompt)
            )
            preview[index] = [dict(row._mapping) for row in session.execute(stmt)]
    return preview


def count_results(db: Database, job_id: str) -> int:
    with db.session(readonly=True) as session:
        full_id = resolve_in_session(session, job_id)
        return int(session.execute(select(func.count()).where(RESULTS.c.job_id == full_id)).scalar_one())
