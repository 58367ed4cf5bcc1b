"""Celery tasks: thin drivers over the stage layer (worker.stages), one task per stage.

ingest_source (ingest queue)    a range of a source's pages (a video whole) -> unit rows; each
                                stored chunk sends an encode task; the rest of the source goes on
                                in a new task, so no task outlives the broker's redelivery timeout
encode_units (encode queue)     units -> cached visual tokens; one generate task per unit
generate_units (generate queue) hands its units to the process's generate service (a window of
                                requests kept in the engine across messages) and returns once
                                their results are stored: only then is the message acknowledged

Every task is idempotent: it only acts on rows still in the state it expects, so a redelivered
or repeated message changes nothing twice. Whatever takes a job's countdown to 0 closes it
(fan-in in the database, no chords). What a failed delivery means is the one runner's decision
(worker.stages.runner), as in the embedded run: retried with backoff while the error is transient
and tries remain, else given up by its stage (a source or units failed with the cause).

GPU workers run these in a thread pool (`visbatch worker`): task threads mostly wait while one
engine thread works, and Celery's prefetch then keeps a window of messages in the process.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from celery import Task
from celery.exceptions import Reject, Retry, SoftTimeLimitExceeded, TimeLimitExceeded
from celery.signals import worker_process_shutdown, worker_shutting_down

from ingest.spec import JobSpec
from ingest.units import UnitSelection
from storage import repository as repo
from storage.db import Database
from storage.models import FINISHED_JOB_STATUSES, UnitStatus
from storage.rows import UnitTask
from visbatch.settings import Settings
from worker.drivers.fleet.celery_app import app
from worker.retry import RetryPolicy, describe
from worker.runtime import Runtime
from worker.stages.failures import ENCODE, GENERATE, INGEST, SourceWork
from worker.stages.ingest import local_copy
from worker.stages.runner import GaveUp, Stage, TimeLimitHit, UnitsWork, after_failure, settle

log = logging.getLogger(__name__)
SETTINGS = Settings()
POLICY = RetryPolicy(max_retries=SETTINGS.task_max_retries)

# One model per worker process: a job for another model replaces it, so memory stays flat.
_RUNTIMES: dict[str, Runtime] = {}
_RUNTIME_LOCK = threading.Lock()
# A thread-pool worker that also takes ingest tasks splits at most this many sources at once.
_INGEST_SLOTS = threading.BoundedSemaphore(SETTINGS.ingest_workers)


@functools.cache
def _db() -> Database:
    db = Database(SETTINGS.sqlalchemy_url())
    db.ensure_schema()
    return db


def runtime_for(model: str | None) -> Runtime:
    """This process's runtime for `model` (its weights load on first use, once: Runtime.load_model).
    Keyed by the resolved name: a job naming the default model by its path shares the loaded one."""
    from worker.runtime import resolve_model_name

    name = resolve_model_name(model or SETTINGS.model)
    with _RUNTIME_LOCK:
        if name not in _RUNTIMES:
            for other in list(_RUNTIMES):
                _close_service(_RUNTIMES[other])
                _RUNTIMES.pop(other).close()
            rt = _RUNTIMES[name] = Runtime(SETTINGS, model=name, db=_db())
            rt.split_processes = SETTINGS.ingest_processes or 1  # the worker's pool fills the cores
        return _RUNTIMES[name]


def _live_spec(job_id: str) -> JobSpec | None:
    """The job's spec, or None when the job is gone, cancelled or already closed."""
    state = repo.job_state(_db(), job_id)
    if state is None or state[0] in FINISHED_JOB_STATUSES:
        return None
    return JobSpec.model_validate(state[1])


# A live job's spec, reused by generate tasks for this long: the fleet sends a message per unit,
# and reading the job per message was a SQL transaction per page. A job stopped meanwhile loses
# nothing by it: the generate loop looks its jobs up every second (POLL_SECONDS) and aborts their
# requests, and storing results re-reads the jobs' states in its own transaction.
_SPEC_TTL_S = 1.0
_RECENT_SPECS: dict[str, tuple[float, JobSpec]] = {}


def _recent_live_spec(job_id: str) -> JobSpec | None:
    """`_live_spec`, read at most once per _SPEC_TTL_S per job in this process (a finished job is
    never remembered: `visbatch resume` may reopen it)."""
    now = time.monotonic()
    hit = _RECENT_SPECS.get(job_id)
    if hit is not None and now - hit[0] < _SPEC_TTL_S:
        return hit[1]
    spec = _live_spec(job_id)
    if spec is None:
        _RECENT_SPECS.pop(job_id, None)
        return None
    if len(_RECENT_SPECS) > 1024:  # many jobs: forget the stale ones
        for key in [k for k, (at, _) in list(_RECENT_SPECS.items()) if now - at >= _SPEC_TTL_S]:
            _RECENT_SPECS.pop(key, None)
    _RECENT_SPECS[job_id] = (now, spec)
    return spec


class StageTask(Task):
    """A stage as a Celery task, acknowledged after it ran. Each delivery is one try under the one
    runner (worker.stages.runner, through `tried`): its Retry becomes the broker's retry with
    that countdown, so a worker never sleeps holding a message; its GaveUp ends the task."""

    acks_late = True
    # No cap of Celery's own: the one policy decides (a full disk is waited out past its tries).
    max_retries = None
    stage: Stage

    def work(self, args: tuple) -> object:
        """The stage's work named by the message's arguments."""
        raise NotImplementedError

    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        # Only what escaped a try: a hard time limit (the pool killed the try), a lost worker.
        settle(self.stage, self.work(args), _as_stage_error(exc), self.request.retries + 1, _db())


def _as_stage_error(exc: BaseException) -> BaseException:
    """Celery's time limits as the stages know them (worker.stages.runner.TimeLimitHit)."""
    if isinstance(exc, SoftTimeLimitExceeded | TimeLimitExceeded):
        return TimeLimitHit(SETTINGS.task_time_limit)
    return exc


def tried(fn: Callable[..., str]) -> Callable[..., str]:
    """The task body as one try of its stage: a failure goes to the runner, which decides."""

    @functools.wraps(fn)
    def run(self: StageTask, *args: object, **kwargs: object) -> str:
        try:
            return fn(self, *args, **kwargs)
        except (Reject, Retry):
            raise
        except Exception as exc:
            decision = after_failure(
                self.stage,
                self.work(args),
                _as_stage_error(exc),
                tries=self.request.retries + 1,
                policy=POLICY,
                db=_db(),
            )
            if isinstance(decision, GaveUp):
                return f"gave up: {describe(decision.error)}"
            try:
                raise self.retry(exc=exc, countdown=decision.wait) from exc
            except Reject as unpublished:
                # Celery could not publish the retry (the broker is away too) and would drop the
                # message (Reject, requeue=False). Leave it to the broker instead: a requeue, or,
                # if even that cannot be sent, an unacknowledged message that the broker hands
                # out again (RabbitMQ at once, Redis after its timeout).
                log.warning("%s: retry not published (%s); the message stays with the broker",
                            self.name, unpublished.reason)  # fmt: skip
                raise Reject(f"retry not published: {describe(exc)}", requeue=True) from exc

    return run


# --- ingest ---------------------------------------------------------------------------------------


class IngestTask(StageTask):
    stage = INGEST

    def work(self, args: tuple) -> SourceWork:
        return SourceWork(args[0], args[1], args[2])


@app.task(base=IngestTask, bind=True, name="visbatch.ingest_source")
@tried
def ingest_source(self: Task, job_id: str, source_id: int, location: str, first: int = 0) -> str:
    from worker.stages.ingest import ingest_source as ingest_stage

    spec = _live_spec(job_id)
    if spec is None:
        return "skipped: job finished"
    source = repo.source_state(_db(), source_id)
    if source.status != "pending":
        return "skipped: source complete"
    if source.next_unit > first:
        # This range was stored by an earlier delivery, which may have died before handing the
        # rest on: hand it on again (a duplicate range task stops at its own cursor check).
        ingest_source.apply_async((job_id, source_id, location, source.next_unit))
        return "skipped: range done"
    rt = runtime_for(spec.model)

    def send_encode(units: list[UnitTask]) -> None:
        # Before the source's hold is released: a crash in between only resends work.
        ids = [u.unit_id for u in units]
        for start in range(0, len(ids), SETTINGS.encode_chunk_units):
            encode_units.apply_async((job_id, ids[start : start + SETTINGS.encode_chunk_units]))

    selection = UnitSelection(first=first, limit=SETTINGS.ingest_range_units)
    with _INGEST_SLOTS, local_copy(rt, location) as path:
        # A third of the time limit: slow pages end the range early, never the task.
        step = ingest_stage(rt, job_id, source_id, source.uri, path, spec, selection=selection,
                            on_units=send_encode, stop_after_s=SETTINGS.task_time_limit / 3)  # fmt: skip
    if step.next_position is not None and repo.advance_cursor(rt.db, source_id, first, step.next_position):
        ingest_source.apply_async((job_id, source_id, location, step.next_position))
    if spec.window is not None and step.completed:
        # The source's last windows are known now: those ready are asked (storage.windows).
        generate_units.apply_async((job_id, repo.source_unit_ids(rt.db, source_id)))
    return f"{step.units_stored} units"


# --- encode ---------------------------------------------------------------------------------------


class UnitsTask(StageTask):
    def work(self, args: tuple) -> UnitsWork:
        return UnitsWork(args[0], list(args[1]))


class EncodeTask(UnitsTask):
    stage = ENCODE


@app.task(base=EncodeTask, bind=True, name="visbatch.encode_units")
@tried
def encode_units(self: Task, job_id: str, unit_ids: list[int]) -> str:
    from worker.stages.encode import encode_units as encode_stage

    spec = _live_spec(job_id)
    if spec is None:
        return "skipped: job finished"
    rt = runtime_for(spec.model)
    pending = repo.units_by_ids(rt.db, unit_ids, UnitStatus.PENDING)
    step = encode_stage(rt, pending, spec)
    if spec.window is not None:
        # Their windows, failed units' too (such a window's answer is the failure): one message,
        # which asks the windows these units complete (storage.windows).
        generate_units.apply_async((job_id, list(unit_ids)))
        return f"{len(step.encoded)} encoded, {step.failed} failed"
    # Units encoded by an earlier delivery of this message are sent on too (idempotent).
    for unit in repo.units_by_ids(rt.db, unit_ids, UnitStatus.ENCODED):
        generate_units.apply_async((job_id, [unit.unit_id]))
    return f"{len(step.encoded)} encoded, {step.failed} failed"


# --- generate -------------------------------------------------------------------------------------

_SERVICES: dict[int, object] = {}  # id(runtime) -> its GenerateService
_SERVICE_LOCK = threading.Lock()


def _service(rt: Runtime):  # -> GenerateService (imported lazily: it loads the engine)
    from worker.stages.generate import GenerateService

    # Weights first, under the process's load lock (ModelUnavailable, transient, when they cannot
    # load): the service lock is then never held through a slow or failing load.
    rt.load_model()
    with _SERVICE_LOCK:
        service = _SERVICES.get(id(rt))
        if service is None or not service.alive:  # type: ignore[attr-defined]
            service = _SERVICES[id(rt)] = GenerateService(rt)
        return service


def _close_service(rt: Runtime) -> None:
    with _SERVICE_LOCK:
        service = _SERVICES.pop(id(rt), None)
    if service is not None:
        service.close(timeout=30)  # type: ignore[attr-defined]


@worker_process_shutdown.connect
def _metrics_of_a_gone_process(pid: int | None = None, **_: object) -> None:
    """A recycled pool process: its live gauges leave the worker's sums (multiprocess metrics)."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid())


@worker_shutting_down.connect
def _on_shutdown(**_: object) -> None:
    """Warm shutdown (SIGTERM): units in the engine go back to the broker instead of being lost
    or finished late: their tasks are rejected with requeue, another worker takes them."""
    for rt in list(_RUNTIMES.values()):
        _close_service(rt)


class GenerateTask(UnitsTask):
    stage = GENERATE


@app.task(base=GenerateTask, bind=True, name="visbatch.generate_units")
@tried
def generate_units(self: Task, job_id: str, unit_ids: list[int]) -> str:
    from worker.stages.generate import ServiceClosed, UnitIds

    spec = _recent_live_spec(job_id)
    if spec is None:
        return "skipped: job finished"
    rt = runtime_for(spec.model)
    # The service reads the units still encoded together with the other messages waiting for it.
    future: Future = _service(rt).submit(UnitIds(unit_ids, spec))  # type: ignore[attr-defined]
    try:
        outcome = future.result()
    except ServiceClosed as exc:
        raise Reject(f"worker shutting down: {exc}", requeue=True) from exc
    return f"{outcome.stored} stored, {outcome.dropped} dropped"
