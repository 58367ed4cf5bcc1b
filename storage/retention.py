"""Retention: delete finished jobs with their results, units, sources and the cached visual tokens
no remaining job uses (`visbatch purge`; "prune" is token pruning in this project).

Deletes go in batches of units, each batch its own short transaction (its results, then the
units), so that purging a job of 10 million results never holds one transaction that locks the
tables for minutes, and an interrupted purge is finished by running it again: the job row goes
last, so the job is still found until everything under it is gone.

Cached tokens are content-addressed (one entry serves every job whose page has the same pixels
at the same bounds), so an entry is deleted only when no unit of another job refers to it
(``units.cache_key``, indexed by migration 0007) and no queued or running job will use it. A
live job's page names its entry only once it is encoded; before that the entry is known by what
makes its key (``VisualTokenStore.cache_key``: the pixels' hash, which is the image key, with the
model and the job's bounds). Purge cannot build a key without the model, so it keeps by content,
a superset: an entry whose page has the pixels of a live job's page still pending
(``units.image_key``), or comes from the same file as a live job's source not yet split
(``sources.sha256``, or its uri while the file is not opened yet). Those lookups start from the
live jobs' own rows (``ix_units_job_id_status``, the sources' ``(job_id, uri)`` index): what they
read grows with the pages live jobs have still to encode, not with the table, and they cost
nothing while no job is live. The entry goes before the units that name it: a purge stopped in
between leaves units whose entry is already gone (run again, it finishes), never an entry that
nothing names any more. A job started meanwhile that needs a deleted entry encodes its page
again (a miss), it never fails.

Every statement is SQLAlchemy Core with bound parameters.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, func, or_, select

from storage.db import Database
from storage.keys import window_view_key
from storage.models import (
    FINISHED_JOB_STATUSES,
    JOBS,
    RESULTS,
    SOURCES,
    UNITS,
    JobStatus,
    SourceStatus,
    UnitStatus,
)
from storage.sql import IN_CHUNK, JobNotFound, chunks, resolve_in_session

# Units per transaction: with 4 prompts, 20,000 result rows, well under a second each.
UNITS_PER_BATCH = 5000
# Image keys per look-up of the live jobs' pending pages (under both databases' parameter limits).
_KEYS_PER_SCAN = UNITS_PER_BATCH


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
    """What a purge deleted (or, for a dry run, would delete), and the cached entries it left.

    Each entry of the purged jobs is counted once, in one of three: deleted (``cache_entries``),
    kept because a queued or running job uses or will use it (``entries_kept_live``; ``kept_for``
    says how many each such job needs, ``live_status`` its status), or kept because a finished
    job that stays names it (``entries_kept_shared``)."""

    jobs: int = 0
    sources: int = 0
    units: int = 0
    results: int = 0
    cache_entries: int = 0
    entries_kept_live: int = 0
    entries_kept_shared: int = 0
    kept_for: dict[str, int] = field(default_factory=dict)
    live_status: dict[str, str] = field(default_factory=dict)
    job_ids: list[str] = field(default_factory=list)

    def add(self, other: Purged) -> None:
        """Add ``other``'s counts (not its job ids) to these."""
        for name in ("jobs", "sources", "units", "results", "cache_entries"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.entries_kept_live += other.entries_kept_live
        self.entries_kept_shared += other.entries_kept_shared
        for job_id, count in other.kept_for.items():
            self.kept_for[job_id] = self.kept_for.get(job_id, 0) + count
        self.live_status.update(other.live_status)


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


def orphaned_entries(db: Database, job_ids: Sequence[str], *, batch: int = UNITS_PER_BATCH) -> int:
    """How many distinct cached entries purging ``job_ids`` (in this order) deletes: see
    preview_entries, which also says what it keeps and why."""
    return preview_entries(db, job_ids, batch=batch).cache_entries


def preview_entries(db: Database, job_ids: Sequence[str], *, batch: int = UNITS_PER_BATCH) -> Purged:
    """What purging ``job_ids`` in this order does to the token cache, deleting nothing (for
    --dry-run): the same walk and the same rules as purge_jobs, the jobs before each one counted
    as gone. Only the entry fields of the answer are filled in."""
    total = Purged()
    order = _order(job_ids)
    for job_id in job_ids:
        for _, orphans, kept in _batches(db, job_id, batch=batch, entries=True, order=order, dry_run=True):
            total.cache_entries += len(orphans)
            total.add(kept)
    return total


def _order(job_ids: Sequence[str]) -> dict[str, int]:
    """Each job of a purge -> its place in it."""
    return {job_id: i for i, job_id in enumerate(job_ids)}


def _live_jobs(session: Connection) -> dict[str, str]:
    """The queued and running jobs (the jobs' status index): id -> status."""
    live = sorted(set(JobStatus) - FINISHED_JOB_STATUSES)  # IN, not NOT IN: the index serves it
    rows = session.execute(select(JOBS.c.id, JOBS.c.status).where(JOBS.c.status.in_(live)))
    return {row.id: row.status for row in rows}


def _sort_entries(
    session: Connection,
    job_id: str,
    rows: Sequence[Any],
    *,
    order: Mapping[str, int] | None = None,
    dry_run: bool = False,
) -> tuple[list[str], Purged]:
    """Which of the entries named by ``rows`` (a batch of the job's units, in id order) go now, and
    the others' counts (``kept``: the entry fields of a Purged).

    An entry is left to a later batch when a later unit of this job, or a unit of a job later in
    this purge (``order``: each job's place in it), names it: the last that names it decides,
    once. Otherwise it is kept for a live (queued or running) job that names it, whose unit still
    pending has the same pixels (``image_key``), or whose source not yet split is the same file
    (its sha256 once pinned, before that its uri); else kept while a finished job that stays
    names it; else it goes. In a ``dry_run`` the units of the jobs before this one count as
    deleted already."""
    order = order or {}
    mine = order.get(job_id, -1)
    last = rows[-1].id
    by_key: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        if row.cache_key is not None:
            by_key[row.cache_key].append(row)
    keys = sorted(by_key)
    users: dict[str, set[str]] = defaultdict(set)
    later: set[str] = set()
    for chunk in chunks(keys):
        stmt = select(UNITS.c.cache_key, UNITS.c.job_id).where(
            UNITS.c.cache_key.in_(chunk), or_(UNITS.c.job_id != job_id, UNITS.c.id > last)
        )
        for key, user in session.execute(stmt.distinct()):
            place = order.get(user, -1)
            if place > mine or user == job_id:
                later.add(key)
            elif not (dry_run and place >= 0):  # a dry run's earlier job: deleted by then
                users[key].add(user)
    undecided = [key for key in keys if key not in later]
    kept = Purged()
    live = _live_jobs(session) if undecided else {}
    needs = {key: users[key] & live.keys() for key in undecided}
    if live:
        rows_of = [row for key in undecided for row in by_key[key]]
        by_image = _pending_pages(session, live, sorted({r.image_key for r in rows_of if r.image_key}))
        by_source = _unsplit_files(session, live, sorted({r.source_id for r in rows_of}))
        for key in undecided:
            for row in by_key[key]:
                needs[key] |= by_image.get(row.image_key, set()) | by_source.get(row.source_id, set())
    orphans = []
    for key in undecided:
        if needs[key]:
            kept.entries_kept_live += 1
            for user in needs[key]:
                kept.kept_for[user] = kept.kept_for.get(user, 0) + 1
                kept.live_status[user] = live[user]
        elif users[key]:
            kept.entries_kept_shared += 1
        else:
            orphans.append(key)
    return orphans, kept


def _pending_pages(
    session: Connection, live: Collection[str], image_keys: Sequence[str]
) -> dict[str, set[str]]:
    """image key -> the live jobs with a unit of those pixels still pending (not encoded yet, so
    not naming its entry): read from the live jobs' pending units (``ix_units_job_id_status``),
    once for a whole batch (each query reads them all: 5,000 keys in one list, not 5 of 1,000)."""
    found: dict[str, set[str]] = defaultdict(set)
    for jobs in chunks(sorted(live)):
        for chunk in chunks(image_keys, _KEYS_PER_SCAN):
            stmt = (
                select(UNITS.c.image_key, UNITS.c.job_id)
                .where(
                    UNITS.c.job_id.in_(jobs),
                    UNITS.c.status == UnitStatus.PENDING.value,
                    UNITS.c.image_key.in_(chunk),
                )
                .distinct()
            )
            for image_key, user in session.execute(stmt):
                found[image_key].add(user)
    return found


def _unsplit_files(
    session: Connection, live: Collection[str], source_ids: Sequence[int]
) -> dict[int, set[str]]:
    """source id (of the purged job) -> the live jobs with a source not split yet (pending) that
    is the same file: the same sha256 once its first pages pinned it, the same uri before that.
    Every page of such a file may come: all of the source's entries are kept."""
    files: dict[int, tuple[str | None, str]] = {}
    for chunk in chunks(source_ids):
        stmt = select(SOURCES.c.id, SOURCES.c.sha256, SOURCES.c.uri).where(SOURCES.c.id.in_(chunk))
        files.update({row.id: (row.sha256, row.uri) for row in session.execute(stmt)})
    shas = sorted({sha for sha, _ in files.values() if sha is not None})
    uris = sorted({uri for _, uri in files.values()})
    by_sha: dict[str, set[str]] = defaultdict(set)
    by_uri: dict[str, set[str]] = defaultdict(set)
    for jobs in chunks(sorted(live)):
        pending = (SOURCES.c.job_id.in_(jobs), SOURCES.c.status == SourceStatus.PENDING.value)
        for chunk in chunks(shas):
            stmt = select(SOURCES.c.sha256, SOURCES.c.job_id).where(*pending, SOURCES.c.sha256.in_(chunk))
            for sha, user in session.execute(stmt):
                by_sha[sha].add(user)
        for chunk in chunks(uris):
            stmt = select(SOURCES.c.uri, SOURCES.c.job_id).where(
                *pending, SOURCES.c.sha256.is_(None), SOURCES.c.uri.in_(chunk)
            )
            for uri, user in session.execute(stmt):
                by_uri[uri].add(user)
    found: dict[int, set[str]] = {}
    for source_id, (sha, uri) in files.items():
        users = (by_sha.get(sha, set()) if sha is not None else set()) | by_uri.get(uri, set())
        if users:
            found[source_id] = users
    return found


def _batches(
    db: Database,
    job_id: str,
    *,
    batch: int,
    entries: bool,
    order: Mapping[str, int] | None = None,
    dry_run: bool = False,
) -> Iterator[tuple[list[int], list[str], Purged]]:
    """The job's units ``batch`` at a time (keyset by id: each batch starts where the last one
    ended, so deleting a batch's rows between two does not move it): their ids, and (when
    ``entries``) the entries that go with them and the counts of those kept (_sort_entries)."""
    after = -1
    while True:
        with db.session(readonly=True) as session:
            rows = session.execute(
                select(UNITS.c.id, UNITS.c.cache_key, UNITS.c.image_key, UNITS.c.source_id)
                .where(UNITS.c.job_id == job_id, UNITS.c.id > after)
                .order_by(UNITS.c.id)
                .limit(batch)
            ).all()
            if not rows:
                return
            after = rows[-1].id
            orphans, kept = (
                _sort_entries(session, job_id, rows, order=order, dry_run=dry_run)
                if entries
                else ([], Purged())
            )
        yield [row.id for row in rows], orphans, kept


def purge_job(
    db: Database,
    job_id: str,
    *,
    delete_entries: Callable[[list[str]], int] | None = None,
    batch: int = UNITS_PER_BATCH,
    progress: Callable[[Purged], None] | None = None,
    order: Mapping[str, int] | None = None,
) -> Purged:
    """Delete one finished job (full id) and everything under it, ``batch`` units per transaction.

    ``delete_entries(keys)`` deletes cached entries and returns how many it was asked to delete
    (None: the token cache is left alone). The entries a live job uses or will use, or a job
    after this one in ``order`` (purge_jobs': each job's place) names, stay (_sort_entries).
    Raises JobRunning for a job that is not finished.
    """
    done = Purged(job_ids=[job_id])
    with db.session(readonly=True) as session:
        status = session.scalar(select(JOBS.c.status).where(JOBS.c.id == job_id))
    if status is None:
        raise JobNotFound(f"no job {job_id!r}")
    if status not in FINISHED_JOB_STATUSES:
        raise JobRunning(f"job {job_id} is {status}: only finished jobs are purged (cancel it first)")
    for ids, orphans, kept in _batches(
        db, job_id, batch=batch, entries=delete_entries is not None, order=order
    ):
        done.add(kept)
        if orphans and delete_entries is not None:
            done.cache_entries += delete_entries(orphans)  # before the units that name them
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
    """purge_job for each job, oldest first as given; the totals (an entry that several of them
    name is decided, and counted, by the last)."""
    total = Purged()
    order = _order(job_ids)
    for job_id in job_ids:
        one = purge_job(
            db,
            job_id,
            delete_entries=delete_entries,
            batch=batch,
            progress=(lambda p, j=job_id: progress(j, p)) if progress else None,
            order=order,
        )
        total.add(one)
        total.job_ids.append(job_id)
    return total


__all__ = [
    "UNITS_PER_BATCH",
    "JobRunning",
    "PurgeCandidate",
    "Purged",
    "find_purgeable",
    "orphaned_entries",
    "preview_entries",
    "purge_job",
    "purge_jobs",
]


def cache_deleter(cache: Any) -> Callable[[list[str]], int]:
    """``delete_entries`` for purge_job over a token cache (storage.token_cache): many keys per
    request where the tier allows it (one Redis DEL per 500 keys, one S3 DeleteObjects per 1000),
    else one delete per key. Returns how many keys it was given."""

    def delete_entries(keys: list[str]) -> int:
        # With each entry its window view, where a window of several images made one (a key
        # derived from the entry's: deleting one that was never made costs a key in the request).
        _delete_from(cache, keys + [window_view_key(key) for key in keys])
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
