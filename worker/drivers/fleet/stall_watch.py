"""The fleet's safety net for stuck jobs: a running job with work left, no progress for
`VISBATCH_STALL_AFTER_S` (120 s) and no message waiting that could move it, is resumed by the fleet
itself, at most once per that threshold.

Messages should never be lost (late acks, redelivery, retries that leave the message to the
broker), but an operator running a fleet unattended cannot rely on "should": a broker restart at
the wrong moment, a message rejected by an older worker, a worker killed between two writes. So
every worker (and the drop-folder watcher) runs `resume_stalled_jobs` every ~30 s (jittered, so a
fleet started at once does not sweep at once), and one of them at a time (a PostgreSQL advisory
lock; on SQLite the database file is the lock, and the claim below decides anyway):

1. candidates: fleet jobs `running` whose last progress (jobs.updated_at: every stage moves the
   job row as it works) and last resume (jobs.resumed_at: this watch's or `visbatch resume`'s) are
   older than the threshold;
2. a job whose work waits in a queue that still holds messages is left alone (it may be behind
   them: re-sending would only pile duplicates behind the same backlog), and so is one whose
   queue has no worker at all (`visbatch status` says "waiting: no worker on queue ..."); a job
   with nothing left but never closed is closed;
3. the job is claimed by a conditional UPDATE that stamps resumed_at (one sweeper wins), reopened
   exactly like `visbatch resume` (storage.jobs.reopen_job: failed sources and units get another
   try, the countdown is recounted from the rows) and its work is sent again: an ingest task per
   pending source from its cursor, encode tasks for stored units, a generate task per encoded
   unit. Tasks are idempotent, so a message that was only slow, not lost, does no harm.

On Redis the broker can show every message a job has: the waiting ones in its queues, the taken
ones in kombu's record of unacknowledged deliveries (worker.drivers.fleet.consumers.held_jobs). A
job idle for LOST_AFTER_S whose needed queues are empty and of which no worker holds a message has
lost its messages, and is resumed then, not after the threshold. That happens when a worker dies
between the broker's pop (BRPOP) and its record of the delivery, or while the broker sends to a
connection already dead: one generate message of a job was lost so when a worker was SIGKILLed
holding deliveries (tests/test_two_hosts.py), and came back only through this watch, 141 s after
the kill. RabbitMQ lists no unacknowledged message, and hands a dropped connection's back itself.

Nothing here may stop a worker: every error of a sweep is logged and the next sweep tries again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from celery.signals import worker_ready, worker_shutting_down

from storage import jobs
from storage.db import Database
from storage.models import utcnow
from visbatch.settings import Settings
from worker.drivers.fleet import heartbeats
from worker.drivers.fleet.consumers import QueueState
from worker.drivers.fleet.heartbeats import WorkerCard
from worker.drivers.fleet.instance import this_instance
from worker.drivers.job_activity import format_duration

log = logging.getLogger(__name__)

# Idle this long with no message anywhere in the broker: lost (the docstring); seconds.
LOST_AFTER_S = 20.0

# pg_try_advisory_xact_lock key of the sweep ("visb" in ASCII): one sweeper at a time per database.
SWEEP_LOCK_KEY = 0x76697362

Send = Callable[[str, tuple[Any, ...]], None]  # (stage, task args): put one task on the stage's queue
QueueStates = Callable[[Sequence[str]], "dict[str, QueueState] | None"]
HeldJobs = Callable[[], "set[str] | None"]  # the jobs workers hold messages of; None: unknown


@dataclass(frozen=True, slots=True)
class Resumed:
    """One job the sweep acted on: resumed (its work sent again), or closed (nothing was left)."""

    job_id: str
    idle_seconds: float
    action: str  # "resumed", "closed", or "lost" (resumed early: no message of it in the broker)
    sent: dict[str, int]  # tasks sent per stage


def celery_send(stage: str, args: tuple[Any, ...]) -> None:
    """Send by task name (routed to the stage's queue by the app's routes): no task module import."""
    from worker.drivers.fleet.celery_app import TASKS, app

    app.send_task(TASKS[stage], args=list(args))


def broker_states(settings: Settings) -> QueueStates:
    from worker.drivers.fleet.consumers import queue_states

    return lambda stages: queue_states(settings, stages, timeout=5.0)


def broker_held(settings: Settings) -> HeldJobs:
    from worker.drivers.fleet.consumers import held_jobs

    return lambda: held_jobs(settings, timeout=5.0)


@contextlib.contextmanager
def _sweep_lock(db: Database) -> Iterator[bool]:
    """True for the one sweeper holding the lock (PostgreSQL: a transaction-level advisory lock
    held while the sweep runs; SQLite: always true, the claim decides)."""
    if db.engine.dialect.name != "postgresql":
        yield True
        return
    from sqlalchemy import text

    with db.session() as session:
        yield bool(session.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": SWEEP_LOCK_KEY}))


def resume_stalled_jobs(
    db: Database,
    settings: Settings,
    *,
    send: Send = celery_send,
    states: QueueStates | None = None,
    held: HeldJobs | None = None,
    now: datetime | None = None,
) -> list[Resumed]:
    """One sweep: resume (or close) each stalled fleet job, and each job the broker shows lost;
    returns what it did.

    `send`, `states` and `held` are the broker seams (tests pass a recorder, fixed queue states
    and fixed held jobs).
    """
    now = now or utcnow()
    before = now - timedelta(seconds=settings.stall_after_s)
    before_lost = now - timedelta(seconds=min(LOST_AFTER_S, settings.stall_after_s))
    states = states or broker_states(settings)
    held = held or broker_held(settings)
    done: list[Resumed] = []
    with _sweep_lock(db) as holder:
        if not holder:
            return done
        seen: dict[str, QueueState] | None = None
        held_once = functools.cache(held)  # asked at most once a sweep, and only when needed
        for job_id, progress_at, stalled in jobs.stall_candidates(db, before_lost, threshold=before):
            idle = (now - progress_at).total_seconds()
            needed = jobs.outstanding_work(db, job_id).stages()
            lost = not stalled  # idle, not yet for the threshold: only if shown lost
            if lost and not needed:
                continue  # nothing to send; closing a job that was never closed waits the threshold
            if needed:
                if seen is None:
                    seen = states(jobs.STAGES)
                    if seen is None:
                        log.info("stall watch: the broker cannot tell its queues now; next sweep")
                        return done
                why_not = _still_served(seen, needed)
                if why_not:
                    log.debug("stall watch: job %s idle %.0f s but %s", job_id, idle, why_not)
                    continue
            if lost:
                known = held_once()  # None: the broker cannot show held messages; the threshold waits
                if known is None or job_id in known:
                    continue
            if not jobs.claim_stalled(db, job_id, before_lost if lost else before, now):
                continue  # another sweeper took it, or it moved meanwhile
            try:
                done.append(_act(db, settings, job_id, idle, send, lost=lost))
            except jobs.JobNotFound:
                continue  # deleted meanwhile
    return done


def _still_served(seen: dict[str, QueueState], needed: Sequence[str]) -> str | None:
    """Why re-sending a job's work would not help: its queue holds messages it may be behind, or
    no worker consumes it."""
    for stage in needed:
        state = seen.get(stage)
        if state is None:
            continue
        if state.messages:
            return f"queue {stage} still holds {state.messages} message(s)"
        if state.consumers == 0:
            return f"no worker on queue {stage}"
    return None


def _act(db: Database, settings: Settings, job_id: str, idle: float, send: Send, *, lost: bool) -> Resumed:
    if lost:
        # Only the lost messages are sent again: the job's rows and counts are right, and a failed
        # unit stays failed (retrying it is `visbatch resume`'s, or the threshold's).
        sent = send_outstanding(jobs.outstanding_work(db, job_id), job_id, settings, send)
        log.warning(
            "job %s: no progress for %s and none of its messages in the broker (not queued, held by no "
            "worker): lost with a worker that died?; sent again by the stall watch (%d source(s) to "
            "ingest, %d unit(s) to encode, %d to generate)",
            job_id,
            format_duration(idle),
            sent["ingest"],
            sent["encode_units"],
            sent["generate"],
        )
        return Resumed(job_id, idle, "lost", sent)
    if not jobs.outstanding_work(db, job_id).stages():
        status = jobs.close_job(db, job_id)
        log.warning(
            "job %s: no progress for %s and no work left, but never closed: closed (%s) by the stall watch",
            job_id,
            format_duration(idle),
            status,
        )
        return Resumed(job_id, idle, "closed", {})
    reopened = jobs.reopen_job(db, job_id)
    sent = send_outstanding(jobs.outstanding_work(db, job_id), job_id, settings, send)
    log.warning(
        "job %s: no progress for %s and no message left for it (lost?): resumed by the stall watch "
        "(%d source(s) to ingest, %d unit(s) to encode, %d to generate; %d failed unit(s) retried)",
        job_id,
        format_duration(idle),
        sent["ingest"],
        sent["encode_units"],
        sent["generate"],
        reopened.units_reset,
    )
    return Resumed(job_id, idle, "resumed", sent)


def send_outstanding(work: jobs.Outstanding, job_id: str, settings: Settings, send: Send) -> dict[str, int]:
    """Send a job's work left as the tasks that do it (the same messages ingest and encode send)."""
    for source_id, location, next_unit in work.sources:
        send("ingest", (job_id, source_id, location, next_unit))
    chunk = settings.encode_chunk_units
    encode_tasks = 0
    for start in range(0, len(work.pending_units), chunk):
        send("encode", (job_id, work.pending_units[start : start + chunk]))
        encode_tasks += 1
    for unit_id in work.encoded_units:
        send("generate", (job_id, [unit_id]))
    return {
        "ingest": len(work.sources),
        "encode": encode_tasks,
        "encode_units": len(work.pending_units),
        "generate": len(work.encoded_units),
    }


# --- the thread in each worker (and in the drop-folder watcher) -----------------------------------


class StallWatch:
    """A daemon thread: every ~stall_check_s (jittered) it beats this worker's heartbeat (its card:
    worker.drivers.fleet.heartbeats, the jobs of the tasks in hand with it) and sweeps for stalled jobs.
    Never raises."""

    def __init__(self, settings: Settings, *, card: WorkerCard | None = None) -> None:
        self.settings = settings
        self.card = card
        self.stop = threading.Event()
        self._db: Database | None = None
        self.thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> StallWatch:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        if self.card is not None:
            with contextlib.suppress(Exception):
                heartbeats.withdraw(self.settings, self.card)

    def _run(self) -> None:
        # The first beat at once (a worker is consuming from now on), the first sweep after a
        # random part of an interval (a fleet started together spreads its sweeps).
        self._beat()
        while not self.stop.wait(self.settings.stall_check_s * random.uniform(0.5, 1.5)):  # noqa: S311
            self._beat()
            self._sweep()

    def _beat(self) -> None:
        if self.card is None:
            return
        try:
            heartbeats.beat(self.settings, replace(self.card, jobs=jobs_in_hand()))
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat is retried at the next one
            log.info("stall watch: no heartbeat for %s: %s: %s", self.card.instance, type(exc).__name__, exc)

    def _sweep(self) -> None:
        try:
            if self._db is None:
                db = Database(self.settings.sqlalchemy_url())
                db.ensure_schema()
                self._db = db
            resume_stalled_jobs(self._db, self.settings)
        except Exception:  # noqa: BLE001 - the safety net must never take the worker down
            log.warning(
                "stall watch: sweep failed; next one in ~%.0f s", self.settings.stall_check_s, exc_info=True
            )
        finally:
            if self._db is not None:
                # No pooled connection kept between sweeps: a pool process forked later inherits none.
                with contextlib.suppress(Exception):
                    self._db.dispose()


_WATCH: StallWatch | None = None


def _stages_of(consumer: Any, settings: Settings) -> list[str]:
    """The stages whose queues a Celery consumer takes messages from."""
    from worker.drivers.fleet.queues import QUEUES, queue_name

    names = {q.name for q in consumer.task_consumer.queues}
    return [stage for stage in QUEUES if queue_name(settings, stage) in names]


def jobs_in_hand() -> tuple[str, ...]:
    """The jobs of the tasks this worker runs now (every task's first argument is its job id):
    Celery's own record of its active requests, kept in the main process for every pool."""
    from celery.worker import state

    jobs: set[str] = set()
    for request in list(state.active_requests):
        with contextlib.suppress(Exception):  # a request without arguments is not a stage's
            jobs.add(str(request.args[0]))
    return tuple(sorted(jobs))


def _card_of(consumer: Any, settings: Settings) -> WorkerCard:
    """This worker's card: the one `visbatch worker` made (worker.drivers.fleet.heartbeats), with the
    node name and queues Celery runs under; a worker started otherwise gets one here."""
    stages = _stages_of(consumer, settings) if consumer is not None else []
    name = str(getattr(consumer, "hostname", "") or "")
    card = heartbeats.this_worker() or heartbeats.card_for_this_process(this_instance(), stages)
    return replace(card, name=name or card.name, queues=tuple(stages) or card.queues)


@worker_ready.connect
def _start_on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _WATCH
    try:
        settings = Settings()
        _WATCH = StallWatch(settings, card=_card_of(sender, settings)).start()
    except Exception:  # noqa: BLE001 - a worker without its safety net still works
        log.warning("stall watch: not started", exc_info=True)


@worker_shutting_down.connect
def _stop_on_shutdown(**_: Any) -> None:
    if _WATCH is not None:
        _WATCH.close()
