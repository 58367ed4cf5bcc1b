"""Jobs: creating one with its sources, its state, closing it, and what `status` and `jobs` show."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Select, case, false, func, literal, null, select, true, update

from storage.db import Database
from storage.leases import lease_view
from storage.models import (
    FINISHED_JOB_STATUSES,
    JOBS,
    RESULTS,
    SOURCES,
    UNITS,
    JobStatus,
    SourceStatus,
    UnitStatus,
    UTCDateTime,
    new_job_id,
    utcnow,
)
from storage.sql import (
    MAX_ERRORS,
    RESULT_COLUMNS,
    UNFINISHED_UNITS,
    JobNotFound,
    bump,
    chunks,
    iso,
    job_status_value,
    now_param,
    resolve_in_session,
)


def create_job(db: Database, spec: Mapping[str, Any], status: str = JobStatus.QUEUED) -> str:
    """Insert a job and return its id. ``spec`` must be JSON (a pydantic model is dumped as JSON)."""
    dump = getattr(spec, "model_dump", None)
    payload = dump(mode="json") if callable(dump) else dict(spec)
    job_id = new_job_id()
    with db.session() as session:
        session.execute(JOBS.insert().values(id=job_id, spec=payload, status=job_status_value(status)))
    return job_id


def set_job_status(db: Database, job_id: str, status: str, error: str | None = None) -> None:
    """Set the status (and error, when given). A finished status stamps finished_at once; an
    unfinished one (a resumed job) clears it."""
    status = job_status_value(status)
    # Whatever moved the job, only close_job's recount is a report `status` may trust unrecounted.
    values: dict[str, Any] = {"status": status, "tokens": None}
    if error is not None:
        values["error"] = error
    if status in FINISHED_JOB_STATUSES:
        values["finished_at"] = func.coalesce(JOBS.c.finished_at, now_param())
    else:
        values["finished_at"] = None
    with db.session() as session:
        changed = session.execute(
            update(JOBS).where(JOBS.c.id == job_id).values(**values).returning(JOBS.c.id)
        )
        if changed.first() is None:
            raise JobNotFound(f"no job {job_id!r}")


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
    sums: Any  # storage.token_report.ResultSums: the one pass over the results


def _tally(session: Connection, job_id: str) -> _Tally:
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
    from storage.token_report import result_sums  # beside the tables it reads

    r = result_sums(session, job_id)
    return _Tally(sources, units, tokens, hits, misses, r.total, r.failed, r.prompt, r.completion, r)


def _final_status(current: str, tally: _Tally) -> str:
    if current == JobStatus.CANCELLED:
        return current
    if tally.results_total - tally.results_failed == 0:
        return JobStatus.FAILED.value
    problems = (
        tally.sources.get(SourceStatus.FAILED, 0)
        + tally.sources.get(SourceStatus.PENDING, 0)  # never ingested
        + tally.units.get(UnitStatus.FAILED, 0)
        + _unfinished(tally)  # closed early
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
        from storage.token_report import token_report  # beside the tables it reads

        values: dict[str, Any] = {
            # Counted once here: `status` of a finished job reads it instead of every result again.
            "tokens": token_report(session, job_id, tally.sums),
            "status": status,
            "finished_at": func.coalesce(JOBS.c.finished_at, now_param()),
            "sources_total": sum(tally.sources.values()),
            "sources_failed": tally.sources.get(SourceStatus.FAILED, 0),
            "units_total": sum(tally.units.values()),
            "units_failed": tally.units.get(UnitStatus.FAILED, 0),
            # The countdown as it should be: unfinished units plus the holds of pending sources.
            "units_pending": _unfinished(tally) + tally.sources.get(SourceStatus.PENDING, 0),
            "results_total": tally.results_total,
            "results_failed": tally.results_failed,
            "cache_hits": tally.cache_hits,
            "cache_misses": tally.cache_misses,
            "visual_tokens": tally.visual_tokens,
            "prompt_tokens": tally.prompt_tokens,
            "completion_tokens": tally.completion_tokens,
        }
        if status == JobStatus.FAILED and job.error is None and not tally.sources:
            values["error"] = "no input files found"
        elif status == JobStatus.FAILED and job.error is None:
            values["error"] = (
                f"no successful result ({tally.sources.get(SourceStatus.FAILED, 0)} sources, "
                f"{tally.units.get(UnitStatus.FAILED, 0)} units and {tally.results_failed} results failed)"
            )
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(**values))
    return status


def resolve_job_id(db: Database, job_id: str) -> str:
    """The full id for a full id or a unique prefix (>= 6 hex digits), like git."""
    with db.session(readonly=True) as session:
        return resolve_in_session(session, job_id)


def _errors_select(job_id: str) -> list[Select[Any]]:
    """Failed sources, failed units, failed results: (source, unit, prompt, message)."""
    failed_sources = (
        select(
            SOURCES.c.uri.label("source"),
            SOURCES.c.kind.label("kind"),
            null().label("unit"),
            null().label("timestamp"),
            null().label("prompt"),
            SOURCES.c.error.label("message"),
        )
        .where(SOURCES.c.job_id == job_id, SOURCES.c.status == SourceStatus.FAILED.value)
        .order_by(SOURCES.c.uri)
    )
    failed_units = (
        select(
            SOURCES.c.uri.label("source"),
            SOURCES.c.kind.label("kind"),
            UNITS.c.unit_index.label("unit"),
            UNITS.c.timestamp.label("timestamp"),
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
            SOURCES.c.kind.label("kind"),
            UNITS.c.unit_index.label("unit"),
            UNITS.c.timestamp.label("timestamp"),
            RESULTS.c.prompt_index.label("prompt"),
            RESULTS.c.error.label("message"),
        )
        .join_from(RESULTS, UNITS, RESULTS.c.unit_id == UNITS.c.id)
        .join(SOURCES, UNITS.c.source_id == SOURCES.c.id)
        .where(RESULTS.c.job_id == job_id, RESULTS.c.error.is_not(None))
        .order_by(SOURCES.c.uri, UNITS.c.unit_index, RESULTS.c.prompt_index)
    )
    return [failed_sources, failed_units, failed_results]


def _collect_errors(
    session: Connection, job_id: str, cap: int, prompts: Sequence[str]
) -> tuple[list[dict[str, Any]], bool]:
    """Errors with where they happened: ``unit`` and ``prompt`` are 0-based indexes (as in the
    tables), ``page_number`` is 1-based (PDFs, as people count), ``prompt_text`` the question."""
    errors: list[dict[str, Any]] = []
    for stmt in _errors_select(job_id):
        room = cap + 1 - len(errors)  # one extra row tells us whether we truncated
        if room <= 0:
            break
        for source, kind, unit, timestamp, prompt, message in session.execute(stmt.limit(room)):
            errors.append(
                {
                    "source": source,
                    "kind": kind,
                    "unit": unit,
                    "page_number": unit + 1 if unit is not None and kind == "pdf" else None,
                    "timestamp": timestamp,
                    "prompt": prompt,
                    "prompt_text": prompts[prompt] if prompt is not None and prompt < len(prompts) else None,
                    "message": message or "",
                }
            )
    truncated = len(errors) > cap
    return errors[:cap], truncated


def job_summary(db: Database, job_id: str, *, max_errors: int = MAX_ERRORS) -> dict[str, Any]:
    """Status, counters and errors of a job (id or unique prefix).

    While the job runs, result counts and token sums are counted live from the results table (so
    they are right mid-run); once close_job has counted them, from the job row (a finished job of
    10 million results is not read again: docs/scale.md). The other counters are maintained as
    work happens.
    """
    with db.session(readonly=True) as session:
        full_id = resolve_in_session(session, job_id)
        job = session.execute(select(JOBS).where(JOBS.c.id == full_id)).one()
        totals = job_totals(session, job)
        prompts = list((job.spec or {}).get("prompts") or [])
        errors, truncated = _collect_errors(session, full_id, max_errors, prompts)
        running = job.status == JobStatus.RUNNING
        # What a running job waits for (status tells a stalled or unserved job from a slow one).
        outstanding = outstanding_counts(session, full_id) if running else None
        fleet = is_fleet_job(session, full_id) if running else None
    return {
        "id": job.id,
        "status": job.status,
        "created_at": iso(job.created_at),
        "updated_at": iso(job.updated_at),
        "finished_at": iso(job.finished_at),
        "spec": job.spec,
        "error": job.error,
        "sources_total": job.sources_total,
        "sources_failed": job.sources_failed,
        "units_total": job.units_total,
        "units_failed": job.units_failed,
        "units_pending": job.units_pending,
        "results": totals.results - totals.failed,
        "results_failed": totals.failed,
        "cache_hits": job.cache_hits,
        "cache_misses": job.cache_misses,
        "visual_tokens": job.visual_tokens,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "tokens": totals.tokens,
        "timing": _timing(job, totals),
        # Last progress (any stage moving the job row), the last resume (`visbatch resume` or the
        # fleet's stall watch), and for a running job: whether it runs on the fleet and the work
        # left per stage.
        "progress_at": iso(job.updated_at),
        "resumed_at": iso(job.resumed_at),
        "fleet": fleet,
        # The process that runs it in one process ("HOST:PID:START"; worker.drivers.job_activity tells
        # whether it is gone).
        "process": job.process,
        "lease": lease_of(job),
        # The cause of the last retry of its work, and when (worker.stages.runner); job_activity
        # says `waiting: ...` while it is recent.
        "waiting": job.waiting if job.status == JobStatus.RUNNING else None,
        "waiting_at": iso(job.waiting_at),
        "outstanding": outstanding,
        "errors": errors,
        "errors_truncated": truncated,
    }


def closed_report(job: Any) -> dict[str, Any] | None:
    """The token report close_job stored for a finished job; None when it must be counted live
    (the job runs, was reopened, or was finished by something other than close_job)."""
    if job.status in FINISHED_JOB_STATUSES and job.tokens is not None:
        return dict(job.tokens)
    return None


@dataclass(frozen=True, slots=True)
class Totals:
    """A job's results and text tokens, and its token report (job_totals)."""

    results: int  # stored results, failed ones included
    failed: int
    prompt_tokens: int
    completion_tokens: int
    tokens: dict[str, Any]
    written_since_resume: int  # results written since the last resume (all of them if none)


def job_totals(session: Connection, job: Any) -> Totals:
    """A job row's totals: from the row itself once close_job has counted them, else counted from
    the rows (with the results written since its last resume: a running job's rate)."""
    report = closed_report(job)
    if report is not None:
        c = (job.results_total, job.results_failed, job.prompt_tokens, job.completion_tokens)
        return Totals(*c, report, job.results_total)
    from storage.token_report import result_sums, token_report  # beside the tables it reads

    # One pass over the results for the totals and the report.
    sums = result_sums(session, job.id, since=resumed_at(job))
    report = token_report(session, job.id, sums)
    return Totals(sums.total, sums.failed, sums.prompt, sums.completion, report, sums.written_since)


def resumed_at(job: Any) -> datetime | None:
    """When the job was last resumed (reopen_job, by `visbatch resume` or the fleet's stall watch),
    None if never since it started: the start of the run now going on, or that ran last."""
    resumed, started = job.resumed_at, job.started_at
    return resumed if resumed is not None and (started is None or resumed > started) else None


def _seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else max(0.0, (end - start).total_seconds())


def _timing(job: Any, totals: Totals) -> dict[str, Any]:
    """Wall time, time to the first result, each stage's busy time (summed over the threads and
    processes that worked on the job: it can exceed the wall time) and pages+frames answered per
    second; for a running job, its rate in this run and when it should end at that rate.

    Rates count answered pages+frames (a page's results over the job's prompts), not those only
    split. A resumed job's rate is measured from the resume: the hours it sat stopped are no
    work. Its rate over the whole wall time would count them, so it has none (the row keeps no
    account of the time each earlier run took).
    """
    end = job.finished_at or utcnow()
    wall = _seconds_between(job.started_at, end)
    resumed = resumed_at(job)
    this_run = _seconds_between(resumed, end) if resumed is not None else wall
    prompts = max(1, len((job.spec or {}).get("prompts") or []))
    eta = rate = None
    if job.status == JobStatus.RUNNING and this_run:
        rate = totals.written_since_resume / prompts / this_run
        eta = job.units_pending / rate if rate > 0 else None  # pending counts source holds too
    return {
        "rate_units_per_second": rate,
        "eta_seconds": eta,
        "started_at": iso(job.started_at),
        "resumed_at": iso(resumed),
        "first_result_at": iso(job.first_result_at),
        "wall_seconds": wall,
        "since_resume_seconds": this_run if resumed is not None else None,
        "first_result_seconds": _seconds_between(job.started_at, job.first_result_at),
        "busy_seconds": {stage: float(getattr(job, f"{stage}_seconds") or 0.0) for stage in STAGES},
        "answered_units_per_second": totals.results / prompts / wall if wall and resumed is None else None,
    }


def list_jobs(db: Database, limit: int = 20) -> list[dict[str, Any]]:
    """The newest jobs first, with their counters; a running job run in one process also has its
    process (and `fleet`: False), for `jobs` to tell one whose process is gone.

    Results are counted as `status` counts them: from the job row once close_job has counted
    them, else from the results (a running, cancelled or interrupted job's row holds no count of
    them: only close_job writes one).
    """
    stmt = select(JOBS).order_by(JOBS.c.created_at.desc(), JOBS.c.id).limit(limit)
    with db.session(readonly=True) as session:
        jobs = session.execute(stmt).all()
        live = _result_counts(session, [job.id for job in jobs if closed_report(job) is None])
        fleet = {
            job.id: is_fleet_job(session, job.id)
            for job in jobs
            if job.status == JobStatus.RUNNING and job.process
        }
    return [
        {
            "id": job.id,
            "status": job.status,
            "created_at": iso(job.created_at),
            "finished_at": iso(job.finished_at),
            "sources_total": job.sources_total,
            "sources_failed": job.sources_failed,
            "units_total": job.units_total,
            "units_failed": job.units_failed,
            "units_pending": job.units_pending,
            "results_total": live[job.id][0] if job.id in live else job.results_total,
            "results_failed": live[job.id][1] if job.id in live else job.results_failed,
            "process": job.process,
            "lease": lease_of(job),
            "fleet": fleet.get(job.id),
        }
        for job in jobs
    ]


def note_waiting(db: Database, job_id: str, reason: str) -> None:
    """Note what the job's work waits for (a retry's cause); not progress: updated_at stays."""
    stmt = (
        update(JOBS)
        .where(JOBS.c.id == job_id, JOBS.c.status == JobStatus.RUNNING.value)
        .values(waiting=reason, waiting_at=now_param(), updated_at=JOBS.c.updated_at)
    )
    with db.session() as session:
        session.execute(stmt)


def _result_counts(session: Connection, job_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """{job: (results, of which failed)} counted from the rows, for the jobs without a count of
    close_job's: two grouped queries (per chunk of IN_CHUNK jobs), each served by an index on
    results.job_id (the failed ones by the partial index of failed answers)."""
    counts = {job_id: (0, 0) for job_id in job_ids}
    for chunk in chunks(sorted(counts)):
        ids = RESULTS.c.job_id.in_(chunk)
        stmt = select(RESULTS.c.job_id, func.count()).where(ids).group_by(RESULTS.c.job_id)
        totals: dict[str, int] = {job_id: n for job_id, n in session.execute(stmt)}
        failed_stmt = stmt.where(RESULTS.c.error.is_not(None))
        failed: dict[str, int] = {job_id: n for job_id, n in session.execute(failed_stmt)}
        for job_id in chunk:
            counts[job_id] = (int(totals.get(job_id, 0)), int(failed.get(job_id, 0)))
    return counts


def lease_of(job: Any) -> dict[str, Any] | None:
    """The lease of the run that holds (or held) the job (storage.leases)."""
    return lease_view(job.lease_holder, job.lease_renewed_at, job.lease_expires_at)


@dataclass(frozen=True, slots=True)
class StartedJob:
    job_id: str
    sources: list[tuple[int, str]]  # (source id, uri) of every source to ingest, in the given order


def start_job(
    db: Database,
    spec: Any,
    sources: Sequence[tuple[str, str | None]],
    locations: Mapping[str, str] | None = None,
) -> StartedJob:
    """Create a running job with its sources in ONE transaction: the only way jobs start.

    `sources` are (uri, error): a source given with an error (e.g. a file that does not exist) is
    stored failed at once; every other source holds the job's countdown up until its ingest
    completes (storage.sources). A job with no source to ingest is closed here (`failed`, and
    "no input files found" when there was no source at all). `locations` ({uri: where a worker
    reads it}) is given for a fleet job: it is what lets any worker send the ingest again.
    """
    dump = getattr(spec, "model_dump", None)
    payload = dump(mode="json") if callable(dump) else dict(spec)
    job_id = new_job_id()
    live: list[tuple[int, str]] = []
    seen: set[str] = set()
    now = utcnow()
    with db.session() as session:
        session.execute(
            JOBS.insert().values(id=job_id, spec=payload, status=JobStatus.RUNNING.value, started_at=now)
        )
        for uri, error in sources:
            if uri in seen:
                continue  # one source per uri (the unique key)
            seen.add(uri)
            status = SourceStatus.FAILED if error else SourceStatus.PENDING
            source_id = session.execute(
                SOURCES.insert()
                .values(
                    job_id=job_id,
                    uri=uri,
                    status=status.value,
                    error=error,
                    created_at=now,
                    location=(locations or {}).get(uri),
                )
                .returning(SOURCES.c.id)
            ).scalar_one()
            if not error:
                live.append((int(source_id), uri))
        bump(
            session,
            job_id,
            sources_total=len(seen),
            sources_failed=len(seen) - len(live),
            units_pending=len(live),
        )
    if not live:
        close_job(db, job_id)
    return StartedJob(job_id, live)


def close_finished(db: Database, remaining: Mapping[str, int]) -> dict[str, str]:
    """Close every job whose countdown reached 0; returns {job_id: final status} of those closed."""
    return {job_id: close_job(db, job_id) for job_id, left in sorted(remaining.items()) if left == 0}


def job_counts_by_status(db: Database) -> dict[str, int]:
    """How many jobs are in each state (the metrics' `visbatch_jobs`)."""
    stmt = select(JOBS.c.status, func.count()).group_by(JOBS.c.status)
    with db.session(readonly=True) as session:
        return {status: int(n) for status, n in session.execute(stmt)}


def job_state(db: Database, job_id: str) -> tuple[str, dict[str, Any]] | None:
    """(status, spec) of a job, or None when it does not exist (a task for a deleted job is dropped)."""
    with db.session(readonly=True) as session:
        row = session.execute(select(JOBS.c.status, JOBS.c.spec).where(JOBS.c.id == job_id)).one_or_none()
    return None if row is None else (row.status, row.spec)


def finished_among(db: Database, job_ids: Sequence[str]) -> set[str]:
    """The jobs among `job_ids` that are finished (cancelled above all) or gone: their work stops."""
    if not job_ids:
        return set()
    with db.session(readonly=True) as session:
        return finished_among_in(session, job_ids)


def finished_among_in(session: Connection, job_ids: Iterable[str]) -> set[str]:
    """finished_among inside the caller's transaction (storage.results reads it before storing)."""
    ids = sorted(set(job_ids))
    live: set[str] = set()
    for chunk in chunks(ids):
        rows = session.execute(select(JOBS.c.id, JOBS.c.status).where(JOBS.c.id.in_(chunk))).all()
        live.update(row.id for row in rows if row.status not in FINISHED_JOB_STATUSES)
    return set(ids) - live


STAGES = ("ingest", "encode", "generate")


def add_stage_seconds(db: Database, job_id: str, stage: str, seconds: float) -> None:
    """Add a stage's busy time on a job (summed over every process that worked on it)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    if seconds <= 0:
        return
    column = JOBS.c[f"{stage}_seconds"]
    with db.session() as session:
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values({column: column + seconds}))


@dataclass(frozen=True, slots=True)
class ReopenedJob:
    job_id: str
    sources: list[tuple[int, str]]  # (source id, uri) to ingest again (or for the first time)
    units_reset: int  # failed units given another try
    results_retried: int  # units whose failed answers are asked again


def reopen_job(db: Database, job_id: str) -> ReopenedJob:
    """Make a stopped job (cancelled, interrupted, failed or partial) runnable again, in place.

    Kept: every stored unit (so no page is rendered again) and every good result. Retried:
    sources that never completed or failed, units that failed after ingest (they have an image),
    and the units whose answers failed (their failed answers are asked again). The countdown is
    recounted from the rows, and resumed_at stamped: this run's rate is measured from it (the
    later of it and the stall watch's claim, which may be stamped at a sweep's own `now`).
    Raises ValueError for a job that succeeded.
    """
    with db.session() as session:
        full_id = resolve_in_session(session, job_id)
        job = session.execute(select(JOBS.c.status).where(JOBS.c.id == full_id).with_for_update()).one()
        if job.status == JobStatus.SUCCEEDED:
            raise ValueError(f"job {full_id} succeeded: nothing to resume")
        session.execute(
            update(SOURCES)
            .where(SOURCES.c.job_id == full_id, SOURCES.c.status == SourceStatus.FAILED.value)
            .values(status=SourceStatus.PENDING.value, error=None)
        )
        units_reset = session.execute(
            update(UNITS)
            .where(
                UNITS.c.job_id == full_id,
                UNITS.c.status == UnitStatus.FAILED.value,
                UNITS.c.image_key.is_not(None),
            )
            .values(status=UnitStatus.PENDING.value, error=None)
            .returning(UNITS.c.id)
        ).all()
        with_failed_answers = select(RESULTS.c.unit_id).where(
            RESULTS.c.job_id == full_id, RESULTS.c.error.is_not(None)
        )
        results_retried = session.execute(
            update(UNITS)
            .where(UNITS.c.status == UnitStatus.DONE.value, UNITS.c.id.in_(with_failed_answers))
            .values(status=UnitStatus.ENCODED.value)
            .returning(UNITS.c.id)
        ).all()
        tally = _tally(session, full_id)
        pending_sources = tally.sources.get(SourceStatus.PENDING, 0)
        now = literal(utcnow(), UTCDateTime())
        session.execute(
            update(JOBS)
            .where(JOBS.c.id == full_id)
            .values(
                resumed_at=case((JOBS.c.resumed_at > now, JOBS.c.resumed_at), else_=now),
                status=JobStatus.RUNNING.value,
                error=None,
                finished_at=None,
                tokens=None,
                sources_failed=tally.sources.get(SourceStatus.FAILED, 0),
                units_failed=tally.units.get(UnitStatus.FAILED, 0),
                units_pending=_unfinished(tally) + pending_sources,
            )
        )
        stmt = (
            select(SOURCES.c.id, SOURCES.c.uri)
            .where(SOURCES.c.job_id == full_id, SOURCES.c.status == SourceStatus.PENDING.value)
            .order_by(SOURCES.c.uri)
        )
        sources = [(int(row.id), row.uri) for row in session.execute(stmt)]
    return ReopenedJob(full_id, sources, len(units_reset), len(results_retried))


def _unfinished(tally: _Tally) -> int:
    return sum(tally.units.get(status, 0) for status in UNFINISHED_UNITS)


# --- stalled jobs (worker.drivers.fleet.stall_watch) ---------------------------------------------
# A job's last progress is jobs.updated_at: every stage moves the job row as it works (counters,
# busy seconds), and the stall watch's own stamp leaves it alone.


@dataclass(frozen=True, slots=True)
class Outstanding:
    """A running job's work left, by the stage that does it next."""

    sources: list[tuple[int, str, int]]  # (source id, where a worker reads it, next unit) to ingest
    pending_units: list[int]  # stored, to encode
    encoded_units: list[int]  # encoded, answers missing

    def stages(self) -> list[str]:
        """The stages (queues) this work waits for, in pipeline order."""
        work = {"ingest": self.sources, "encode": self.pending_units, "generate": self.encoded_units}
        return [stage for stage in STAGES if work[stage]]


def outstanding_work(db: Database, job_id: str) -> Outstanding:
    """What is left of a job, read from the rows (a source without a recorded location is read
    where its uri says, as `visbatch resume` does)."""
    sources_stmt = (
        select(SOURCES.c.id, func.coalesce(SOURCES.c.location, SOURCES.c.uri), SOURCES.c.next_unit)
        .where(SOURCES.c.job_id == job_id, SOURCES.c.status == SourceStatus.PENDING.value)
        .order_by(SOURCES.c.id)
    )
    units_stmt = (
        select(UNITS.c.id, UNITS.c.status)
        .where(
            UNITS.c.job_id == job_id,
            UNITS.c.status.in_([UnitStatus.PENDING.value, UnitStatus.ENCODED.value]),
        )
        .order_by(UNITS.c.id)
    )
    with db.session(readonly=True) as session:
        sources = [(int(sid), str(where), int(nxt)) for sid, where, nxt in session.execute(sources_stmt)]
        units = session.execute(units_stmt).all()
    return Outstanding(
        sources,
        [int(u.id) for u in units if u.status == UnitStatus.PENDING],
        [int(u.id) for u in units if u.status == UnitStatus.ENCODED],
    )


def outstanding_counts(session: Connection, job_id: str) -> dict[str, int]:
    """How much work each stage still has for a job: {ingest: sources, encode: units, generate: units}."""
    sources = session.scalar(
        select(func.count()).where(SOURCES.c.job_id == job_id, SOURCES.c.status == SourceStatus.PENDING.value)
    )
    units_stmt = (
        select(UNITS.c.status, func.count())
        .where(
            UNITS.c.job_id == job_id,
            UNITS.c.status.in_([UnitStatus.PENDING.value, UnitStatus.ENCODED.value]),
        )
        .group_by(UNITS.c.status)
    )
    units = {status: int(n) for status, n in session.execute(units_stmt)}
    return {
        "ingest": int(sources or 0),
        "encode": units.get(UnitStatus.PENDING, 0),
        "generate": units.get(UnitStatus.ENCODED, 0),
    }


def _stalled_since(before: datetime) -> Any:
    """Running, no progress since `before`, not resumed by the fleet since `before` either."""
    return (
        (JOBS.c.status == JobStatus.RUNNING.value)
        & (JOBS.c.updated_at < before)
        & ((JOBS.c.resumed_at.is_(None)) | (JOBS.c.resumed_at < before))
    )


def stall_candidates(
    db: Database, before: datetime, *, threshold: datetime, limit: int = 100
) -> list[tuple[str, datetime, bool]]:
    """(id, last progress, stalled) of the fleet jobs (their sources have a location: submitted,
    not run in one process) running with no progress and no automatic resume since `before`,
    longest still first; `stalled`: none since `threshold` (earlier than `before`) either."""
    fleet = (
        select(SOURCES.c.id).where(SOURCES.c.job_id == JOBS.c.id, SOURCES.c.location.is_not(None)).exists()
    )
    stmt = (
        select(JOBS.c.id, JOBS.c.updated_at, _stalled_since(threshold).label("stalled"))
        .where(_stalled_since(before), fleet)
        .order_by(JOBS.c.updated_at)
        .limit(limit)
    )
    with db.session(readonly=True) as session:
        return [(row.id, row.updated_at, bool(row.stalled)) for row in session.execute(stmt)]


def claim_stalled(db: Database, job_id: str, before: datetime, now: datetime) -> bool:
    """Stamp resumed_at on a job that is still stalled; True for the one caller that did it.

    The conditional UPDATE is the claim (on either database, two sweepers cannot both win), and
    it keeps updated_at as it was: a resume decided is not progress made.
    """
    stmt = (
        update(JOBS)
        .where(JOBS.c.id == job_id, _stalled_since(before))
        .values(resumed_at=literal(now, UTCDateTime()), updated_at=JOBS.c.updated_at)
        .returning(JOBS.c.id)
    )
    with db.session() as session:
        return session.execute(stmt).first() is not None


def is_fleet_job(session: Connection, job_id: str) -> bool:
    """Whether the job was sent to the fleet (its sources were given a location at submit)."""
    stmt = select(SOURCES.c.id).where(SOURCES.c.job_id == job_id, SOURCES.c.location.is_not(None)).limit(1)
    return session.scalar(stmt) is not None


def preview_per_source(
    db: Database, job_id: str, per_source: int = 2, max_sources: int = 6
) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The first good answers of each source (up to ``per_source``, for the first ``max_sources``
    sources by uri), per prompt and turn: the end of `visbatch run` shows every source of a small
    job, not three frames of the first (nor a window's follow-up as if it were the next window).
    ``{(prompt_index, turn): [record as storage.results.iter_results]}``."""
    with db.session(readonly=True) as session:
        full_id = resolve_in_session(session, job_id)
        asked = (RESULTS.c.prompt_index, RESULTS.c.turn)
        rank = func.row_number().over(partition_by=(*asked, SOURCES.c.id), order_by=UNITS.c.unit_index)
        source_rank = func.dense_rank().over(partition_by=asked, order_by=SOURCES.c.uri)
        ranked = (
            select(*RESULT_COLUMNS, rank.label("rank"), source_rank.label("source_rank"))
            .join_from(RESULTS, UNITS, RESULTS.c.unit_id == UNITS.c.id)
            .join(SOURCES, UNITS.c.source_id == SOURCES.c.id)
            .where(RESULTS.c.job_id == full_id, RESULTS.c.error.is_(None))
            .subquery()
        )
        stmt = (
            select(ranked)
            .where(ranked.c.rank <= per_source, ranked.c.source_rank <= max_sources)
            .order_by(ranked.c.prompt_index, ranked.c.turn, ranked.c.source, ranked.c.unit)
        )
        preview: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for row in session.execute(stmt):
            record = {k: v for k, v in row._mapping.items() if k not in ("rank", "source_rank")}
            preview.setdefault((int(record["prompt_index"]), int(record["turn"])), []).append(record)
    return preview
