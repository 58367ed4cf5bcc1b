"""Celery tasks: the embedded pipeline's stages, fanned out per source, unit chunk and unit.

ingest_source (ingest queue)  -> units -> encode_units per chunk (encode queue)
encode_units                  -> one generate_units message per unit (generate queue)
generate_units (batched)      gathers messages from many jobs for up to a fraction of a second,
                              packs their requests by tokens, stores results
Every task is idempotent: it only acts on rows still in the state it expects, so a redelivered
or repeated message changes nothing. The worker whose update takes a job's pending count to 0
closes the job (fan-in in the database, no chords).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from celery import Task
from celery_batches import Batches

from ingest.spec import JobSpec
from storage import fleet
from storage import repository as repo
from storage.db import Database
from storage.models import FINISHED_JOB_STATUSES, UnitStatus
from storage.object_store import ObjectNotFound, download_s3_uri
from storage.settings import Settings
from worker.celery_app import app
from worker.pipeline import (
    IngestOutcome,
    NullProgress,
    generate_and_store,
    ingest_units,
    requests_for,
    unit_bounds,
)
from worker.runtime import Runtime

log = logging.getLogger(__name__)
SETTINGS = Settings()


def _transient_errors() -> tuple[type[BaseException], ...]:
    """Errors worth a retry: a service that is down or slow, not a bad input."""
    import botocore.exceptions
    import redis.exceptions
    import sqlalchemy.exc

    return (
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        botocore.exceptions.EndpointConnectionError,
        botocore.exceptions.ConnectionClosedError,
        botocore.exceptions.ReadTimeoutError,
        ConnectionError,
        TimeoutError,
    )


TRANSIENT = _transient_errors()

# One model per worker process: a job for another model replaces it, so memory stays flat.
_RUNTIMES: dict[str, Runtime] = {}


@functools.cache
def _db() -> Database:
    db = Database(SETTINGS.sqlalchemy_url())
    db.upgrade()
    return db


def runtime_for(model: str | None) -> Runtime:
    name = model or SETTINGS.model
    if name not in _RUNTIMES:
        for other in list(_RUNTIMES):
            _RUNTIMES.pop(other).close()
        _RUNTIMES[name] = Runtime(SETTINGS, model=name, db=_db())
    return _RUNTIMES[name]


def _live_spec(job_id: str) -> JobSpec | None:
    """The job's spec, or None when the job is gone, cancelled or already closed."""
    state = fleet.job_state(_db(), job_id)
    if state is None or state[0] in FINISHED_JOB_STATUSES:
        return None
    return JobSpec.model_validate(state[1])


def _close_if_done(remaining: dict[str, int] | int | None, job_id: str | None = None) -> None:
    counts = remaining if isinstance(remaining, dict) else {job_id: remaining}
    for jid, left in counts.items():
        if jid is not None and left == 0:
            status = repo.close_job(_db(), jid)
            log.info("job %s closed: %s", jid, status)


class StageTask(Task):
    """Retries transient errors with exponential backoff and jitter, a bounded number of times."""

    autoretry_for = TRANSIENT
    retry_backoff = 2
    retry_backoff_max = 60
    retry_jitter = True
    max_retries = SETTINGS.task_max_retries
    acks_late = True


@contextlib.contextmanager
def fetched(rt: Runtime, location: str) -> Iterator[Path]:
    """A local path for a source: as is (shared folder), or streamed from the store or S3 to a temp file."""
    if location.startswith("file://"):
        yield Path(urlparse(location).path)
        return
    with tempfile.TemporaryDirectory(prefix="visbatch-src-") as tmp:
        dest = Path(tmp) / "source"
        if location.startswith("store:"):
            rt.store.download_file(location.removeprefix("store:"), dest)
        elif location.startswith("s3://"):
            # A user's object: any key name (spaces, accents), not one of visbatch's own keys.
            download_s3_uri(location, dest, endpoint_url=SETTINGS.s3_endpoint_url)
        else:
            raise ValueError(f"unknown source location {location!r}")
        yield dest


def _failure_message(stage: str, exc: BaseException) -> str:
    return f"{stage} failed: {type(exc).__name__}: {exc}"


class IngestTask(StageTask):
    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        # Retries are spent or the error is not transient: the source fails, the job goes on.
        job_id, source_id = args[0], args[1]
        remaining = fleet.complete_source(_db(), source_id, error=_failure_message("ingest", exc))
        _close_if_done(remaining, job_id)


@app.task(base=IngestTask, bind=True, name="visbatch.ingest_source")
def ingest_source(self: Task, job_id: str, source_id: int, location: str) -> str:
    spec = _live_spec(job_id)
    if spec is None:
        return "skipped"
    rt = runtime_for(spec.model)
    try:
        with fetched(rt, location) as path:
            outcome = ingest_units(rt, job_id, source_id, path, spec)
    except ObjectNotFound:
        # Permanent: retrying will not make it appear. The source fails, the job goes on.
        outcome = IngestOutcome(error=f"not found: {location.removeprefix('store:')}")
    # Send the encode work before releasing the source's hold: a crash in between only
    # resends (idempotent) work, never leaves units that nobody will encode.
    unit_ids = fleet.source_unit_ids(rt.db, source_id, UnitStatus.PENDING)
    step = SETTINGS.encode_chunk_units
    for start in range(0, len(unit_ids), step):
        encode_units.apply_async((job_id, unit_ids[start : start + step]))
    facts = {"kind": outcome.kind, "sha256": outcome.sha256, "size": outcome.size}
    _close_if_done(fleet.complete_source(rt.db, source_id, error=outcome.error, **facts), job_id)
    return f"{len(unit_ids)} units"


class EncodeTask(StageTask):
    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        unit_ids = args[1]
        pending = fleet.units_by_ids(_db(), unit_ids, UnitStatus.PENDING)
        if pending:
            message = _failure_message("encode", exc)
            _close_if_done(repo.fail_units(_db(), [(u.unit_id, message) for u in pending]))


@app.task(base=EncodeTask, bind=True, name="visbatch.encode_units")
def encode_units(self: Task, job_id: str, unit_ids: list[int]) -> str:
    spec = _live_spec(job_id)
    if spec is None:
        return "skipped"
    rt = runtime_for(spec.model)
    pending = fleet.units_by_ids(rt.db, unit_ids, UnitStatus.PENDING)
    outcomes = rt.tokens.encode_units([(u.unit_id, u.image_key, unit_bounds(u)) for u in pending])
    ok = [(o.unit_id, o.cache_key, o.cache_hit) for o in outcomes if o.error is None]
    failed = [(o.unit_id, o.error) for o in outcomes if o.error is not None]
    if ok:
        repo.mark_units_encoded(rt.db, ok)
    # Units encoded by an earlier delivery of this message are sent on too (idempotent).
    for unit in fleet.units_by_ids(rt.db, unit_ids, UnitStatus.ENCODED):
        generate_units.apply_async((job_id, unit.unit_id))
    if failed:
        _close_if_done(repo.fail_units(rt.db, failed))
    return f"{len(ok)} encoded, {len(failed)} failed"


@app.task(
    base=Batches,
    name="visbatch.generate_units",
    flush_every=SETTINGS.generate_flush_every,
    flush_interval=SETTINGS.generate_flush_interval,
    acks_late=True,
)
def generate_units(requests: list[Any]) -> None:
    """Gathers generate messages from many jobs and packs them into GPU batches together.

    Messages are acknowledged after the flush returns: a worker killed mid-batch leaves them
    unacknowledged, and Redis hands them to another worker after the visibility timeout.
    """
    messages = [(r.args[0], int(r.args[1]), int(r.kwargs.get("attempt", 0))) for r in requests]
    try:
        _generate(messages)
    except TRANSIENT as exc:
        _retry_or_fail(messages, exc)
    except Exception as exc:
        log.exception("generate batch failed")
        _fail_messages(messages, _failure_message("generate", exc))


def _generate(messages: list[tuple[str, int, int]]) -> None:
    by_model: dict[str | None, dict[str, JobSpec]] = defaultdict(dict)
    unit_ids: dict[str, list[int]] = defaultdict(list)
    for job_id, unit_id, _ in messages:
        unit_ids[job_id].append(unit_id)
    for job_id in unit_ids:
        spec = _live_spec(job_id)
        if spec is not None:
            by_model[spec.model][job_id] = spec
    for model, specs in by_model.items():
        rt = runtime_for(model)
        ids = [u for job_id in specs for u in unit_ids[job_id]]
        units = fleet.units_by_ids(rt.db, ids, UnitStatus.ENCODED)
        remaining = generate_and_store(rt, requests_for(units, specs), NullProgress())
        _close_if_done(remaining)


def _retry_or_fail(messages: list[tuple[str, int, int]], exc: BaseException) -> None:
    for job_id, unit_id, attempt in messages:
        if attempt < SETTINGS.task_max_retries:
            countdown = min(60, 2**attempt) * (0.5 + random.random())  # backoff with jitter
            generate_units.apply_async((job_id, unit_id), {"attempt": attempt + 1}, countdown=countdown)
        else:
            _fail_messages([(job_id, unit_id, attempt)], _failure_message("generate", exc))


def _fail_messages(messages: list[tuple[str, int, int]], message: str) -> None:
    ids = [unit_id for _, unit_id, _ in messages]
    left = fleet.units_by_ids(_db(), ids, UnitStatus.ENCODED)
    if left:
        _close_if_done(repo.fail_units(_db(), [(u.unit_id, message) for u in left]))
