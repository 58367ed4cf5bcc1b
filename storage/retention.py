"""Retention: delete finished jobs with their results, units, sources and the cached visual tokens
no remaining job uses (`visbatch purge`; "prune" is token pruning in this project).

Deletes go in batches of units, each batch its own short transaction (its results, then the
units), so that purging a job of 10 million results never holds one transaction that locks the
tables for minutes, and an interrupted purge is finished by running it again: the job row goes
last, so the job is still found until everything under it is gone.

Cached tokens are content-addressed (one entry serves every job whose page has the same pixels
at the same bounds), so an entry is deleted only when no unit of another job refers to it
(``units.cache_key``, indexed by migration 0007). The entry goes before the units that name it:
a purge stopped in between leaves units whose entry is already gone (run again, it finishes),
never an entry that nothing names any more. A job started meanwhile that needs a deleted entry
encodes its page again (a miss), it never fails.

Every statement is SQLAlchemy Core with bound parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, func, or_, select

from storage.db import Database
from storage.models import FINISHED_JOB_STATUSES, JOBS, RESULTS, SOURCES, UNITS
from storage.sql import IN_CHUNK, JobNotFound, chunks, resolve_in_session

# Units per transaction: with 4 prompts, 20,000 result rows, well under a second each.
UNITS_PER_BATCH = 5000


class JobRunning(ValueError):
    """A job that is not finished (queued or running) is never purged: cancel it first."""


@dataclass(frozen=True)
class PurgeCandidate:
    id: str
    status: str
    created_at: datetime
    finished_at: datetime | None
    sources: int
    units: int
    results: int


@dataclass
class Purged:
    """What a purge deleted (or, for a dry run, would delete)."""

    jobs: int = 0
    sources: int = 0
    units: int = 0
    results: int = 0
    cache_entries: int = 0
    job_ids: list[str] = field(default_factory=list)


def _finished() -> Any:
    return JOBS.c.status.in_(sorted(FINISHED_JOB_STATUSES))


def _candidate(session: Connection, row: Any) -> PurgeCandidate:
    """A job with its rows counted (not its counters: a job cancelled by hand was never recounted)."""

    def count(table: Any) -> int:
        return int(
            session.scalar(select(func.count()).select_from(table).where(table.c.job_id == row.id)) or 0
        )

    return PurgeCandidate(
        row.id, row.status, row.created_at, row.finished_at, count(SOURCES), count(UNITS), count(RESULTS)
    )


def find_purgeable(
    db: Database, *, before: datetime | None = None, job: str | None = None
) -> list[PurgeCandidate]:
    """The jobs a purge takes: ``job`` (id or unique prefix; JobRunning unless finished), or every
    finished job that finished (or, lacking that, was created) before ``before``, oldest first."""
    if (before is None) == (job is None):
        raise ValueError("give either a cut-off time or one job")
    columns = (JOBS.c.id, JOBS.c.status, JOBS.c.created_at, JOBS.c.finished_at)
    with db.session(readonly=True) as session:
        if job is not None:
            full_id = resolve_in_session(session, job)
            row = session.execute(select(*columns).where(JOBS.c.id == full_id)).one()
            if row.status not in FINISHED_JOB_STATUSES:
                raise JobRunning(
                    f"job {full_id} is {row.status}: only finished jobs are purged (cancel it first)"
                )
            return [_candidate(session, row)]
        ended = func.coalesce(JOBS.c.finished_at, JOBS.c.created_at)
        stmt = select(*columns).where(_finished(), ended < before).order_by(ended, JOBS.c.id)
        return [_candidate(session, row) for row in session.execute(stmt).all()]


def orphaned_entries(db: Database, job_ids: Sequence[str]) -> int:
    """How many distinct cached entries the units of ``job_ids`` name that no other job's unit
    names: what purging them all deletes from the token cache (for --dry-run)."""
    if not job_ids:
        return 0
    other = UNITS.alias("other")
    still_used = (
        select(other.c.id)
        .where(other.c.cache_key == UNITS.c.cache_key, other.c.job_id.not_in(list(job_ids)))
        .exists()
    )
    stmt = select(func.count(func.distinct(UNITS.c.cache_key))).where(
        UNITS.c.job_id.in_(list(job_ids)), UNITS.c.cache_key.is_not(None), ~still_used
    )
    with db.session(readonly=True) as session:
        return int(session.scalar(stmt) or 0)


def _unused_after(session: Connection, job_id: str, last_unit: int, keys: Iterable[str]) -> list[str]:
    """The keys among ``keys`` (named by the job's units up to ``last_unit``, this batch) that no
    other unit names: none of another job, none of this job's later batches (the last batch that
    names a key deletes it, once)."""
    wanted = sorted(set(keys))
    used: set[str] = set()
    for chunk in chunks(wanted):
        stmt = (
            select(UNITS.c.cache_key)
            .where(UNITS.c.cache_key.in_(chunk), or_(UNITS.c.job_id != job_id, UNITS.c.id > last_unit))
            .distinct()
        )
        used.update(session.scalars(stmt))
    return [key for key in wanted if key not in used]


def purge_job(
    db: Database,
    job_id: str,
    *,
    delete_entries: Callable[[list[str]], int] | None = None,
    batch: int = UNITS_PER_BATCH,
    progress: Callable[[Purged], None] | None = None,
) -> Purged:
    """Delete one finished job (full id) and everything under it, ``batch`` units per transaction.

    ``delete_entries(keys)`` deletes cached entries and returns how many it was asked to delete
    (None: the token cache is left alone). Raises JobRunning for a job that is not finished.
    """
    done = Purged(job_ids=[job_id])
    with db.session(readonly=True) as session:
        status = session.scalar(select(JOBS.c.status).where(JOBS.c.id == job_id))
    if status is None:
        raise JobNotFound(f"no job {job_id!r}")
    if status not in FINISHED_JOB_STATUSES:
        raise JobRunning(f"job {job_id} is {status}: only finished jobs are purged (cancel it first)")
    after = -1
    while True:
        # Keyset over the job's units by id: each batch starts where the last one ended.
        with db.session(readonly=True) as session:
            rows = session.execute(
                select(UNITS.c.id, UNITS.c.cache_key)
                .where(UNITS.c.job_id == job_id, UNITS.c.id > after)
                .order_by(UNITS.c.id)
                .limit(batch)
            ).all()
            if not rows:
                break
            after = rows[-1].id
            keys = [row.cache_key for row in rows if row.cache_key is not None]
            orphans = _unused_after(session, job_id, after, keys) if delete_entries and keys else []
        if orphans and delete_entries is not None:
            done.cache_entries += delete_entries(orphans)  # before the units that name them
        ids = [row.id for row in rows]
        with db.session() as session:
            for chunk in chunks(ids, IN_CHUNK):
                done.results += session.execute(delete(RESULTS).where(RESULTS.c.unit_id.in_(chunk))).rowcount
                done.units += session.execute(delete(UNITS).where(UNITS.c.id.in_(chunk))).rowcount
        if progress is not None:
            progress(done)
    # Results not under one of the job's units (none are written so; kept for safety), then the
    # sources, then the job (drop-folder claims keep their row: their job_id becomes NULL).
    done.results += _delete_by_job(db, RESULTS, job_id, batch * 4)
    done.sources += _delete_by_job(db, SOURCES, job_id, batch)
    with db.session() as session:
        done.jobs += session.execute(delete(JOBS).where(JOBS.c.id == job_id)).rowcount
    if progress is not None:
        progress(done)
    return done


def _delete_by_job(db: Database, table: Any, job_id: str, batch: int) -> int:
    deleted = 0
    while True:
        with db.session() as session:
            ids = session.scalars(select(table.c.id).where(table.c.job_id == job_id).limit(batch)).all()
            for chunk in chunks(list(ids), IN_CHUNK):
                deleted += session.execute(delete(table).where(table.c.id.in_(chunk))).rowcount
        if len(ids) < batch:
            return deleted


def purge_jobs(
    db: Database,
    job_ids: Sequence[str],
    *,
    delete_entries: Callable[[list[str]], int] | None = None,
    batch: int = UNITS_PER_BATCH,
    progress: Callable[[str, Purged], None] | None = None,
) -> Purged:
    """purge_job for each job, oldest first as given; the totals."""
    total = Purged()
    for job_id in job_ids:
        one = purge_job(
            db,
            job_id,
            delete_entries=delete_entries,
            batch=batch,
            progress=(lambda p, j=job_id: progress(j, p)) if progress else None,
        )
        total.jobs += one.jobs
        total.sources += one.sources
        total.units += one.units
        total.results += one.results
        total.cache_entries += one.cache_entries
        total.job_ids.append(job_id)
    return total


__all__ = [
    "UNITS_PER_BATCH",
    "JobRunning",
    "PurgeCandidate",
    "Purged",
    "find_purgeable",
    "orphaned_entries",
    "purge_job",
    "purge_jobs",
]


def cache_deleter(cache: Any) -> Callable[[list[str]], int]:
    """``delete_entries`` for purge_job over a token cache (storage.token_cache): many keys per
    request where the tier allows it (one Redis DEL per 500 keys, one S3 DeleteObjects per 1000),
    else one delete per key. Returns how many keys it was given."""

    def delete_entries(keys: list[str]) -> int:
        _delete_from(cache, keys)
        return len(keys)

    return delete_entries


def _delete_from(cache: Any, keys: list[str]) -> None:
    from storage.token_cache import RedisTokenCache, S3TokenCache, TieredTokenCache

    if isinstance(cache, TieredTokenCache):
        # Cold first, as TieredTokenCache.delete does: the durable copy never outlives the hot one.
        _delete_from(cache.cold, keys)
        _delete_from(cache.hot, keys)
    elif isinstance(cache, RedisTokenCache):
        _delete_redis(cache, keys)
    elif (
        isinstance(cache, S3TokenCache) and hasattr(cache.store, "client") and hasattr(cache.store, "bucket")
    ):
        _delete_s3(cache, keys)
    else:
        for key in keys:
            cache.delete(key)


def _delete_redis(cache: Any, keys: list[str]) -> None:
    import redis

    from storage.keys import check_key

    if not cache.available:
        return  # down: its entries expire on their own (the hot tier's TTL)
    for chunk in chunks(keys, 500):
        try:
            cache.client.delete(*(cache.namespace + check_key(key) for key in chunk))
        except redis.RedisError as exc:
            cache._failed(exc)  # logged once; the TTL expires what is left
            return


def _delete_s3(cache: Any, keys: list[str]) -> None:
    store = cache.store
    for chunk in chunks(keys, 1000):  # DeleteObjects takes at most 1000 keys
        objects = [{"Key": store._key(cache._key(key))} for key in chunk]
        response = store.client.delete_objects(
            Bucket=store.bucket, Delete={"Objects": objects, "Quiet": True}
        )
        errors = response.get("Errors") or []
        if errors:
            first = errors[0]
            raise RuntimeError(
                f"S3 refused to delete {len(errors)} cached entries, e.g. {first.get('Key')}: "
                f"{first.get('Code')} {first.get('Message')}"
            )
