"""One runner for every stage under both drivers: what a failed try means is decided here, once.

A stage is one shape (`Stage`): a name, the job its work belongs to, and `give_up` (what its
last failed try records: a source or units failed with the real cause, the job goes on). Which
errors are worth another try is the one policy's (worker.retry: storage.errors classifies). A
driver only transports: it runs a try of the stage's body and hands a failure to `after_failure`,
which answers `Retry(wait)` or `GaveUp`; the embedded driver waits in its thread (`run_tries`, or
a timer for generation, whose tries end in a Future), a Celery task hands the wait to the broker
as its retry's countdown (worker.drivers.fleet.tasks). As in datatrove's `_run_for_rank`, whatever the
executor, and dramatiq's Retries middleware: one place decides, every stage gets it.

The rules every stage follows here, under both drivers:
- a transient error is tried again while tries remain (a service restarting never fails a unit);
- a run being stopped records nothing (the work stays where it was: `visbatch resume` redoes it);
- the last try's error, or a permanent one, is given up with the tries spent, counted by the
  driver (the embedded run's tries, the Celery message's retries), never guessed;
- a job that finished meanwhile (cancelled, closed) keeps its rows as they are;
- an error that already went through the policy (`RetriesSpent`: the generate service retries
  its own database calls) is given up at once, never retried again: retries never nest.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from storage import repository as repo
from storage.db import Database
from storage.errors import local_fault
from storage.models import FINISHED_JOB_STATUSES
from worker.retry import RetryPolicy, describe

log = logging.getLogger(__name__)

W = TypeVar("W", contravariant=True)
T = TypeVar("T")


class Stopped(Exception):
    """The run is being stopped: nothing is recorded for the work in hand."""


class TimeLimitHit(Exception):
    """A try ran past the driver's time limit (a Celery task's soft or hard limit)."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"the try ran past its time limit ({limit_s:g} s)")
        self.limit_s = limit_s


class RetriesSpent(Exception):
    """`cause` already went through the retry policy (its tries are spent): give it up now."""

    def __init__(self, cause: BaseException, tries: int) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.tries = tries


class Stage(Protocol[W]):
    name: str

    def job_of(self, work: W) -> str: ...

    def describe(self, work: W) -> str:
        """The work in a log line ("ingest a.pdf", "encode 16 units")."""
        ...

    def give_up(self, db: Database, work: W, exc: BaseException, tries: int) -> None:
        """The last try failed with `exc` after `tries` tries: record it on the work's rows."""
        ...


@dataclass(frozen=True, slots=True)
class UnitsWork:
    """Units of one job in the hands of a stage (encode, generate)."""

    job_id: str
    unit_ids: list[int]


@dataclass(frozen=True, slots=True)
class Retry:
    wait: float
    error: BaseException


@dataclass(frozen=True, slots=True)
class GaveUp:
    error: BaseException


def after_failure(
    stage: Stage[W],
    work: W,
    exc: BaseException,
    *,
    tries: int,
    policy: RetryPolicy,
    db: Database,
    stop: threading.Event | None = None,
) -> Retry | GaveUp:
    """The one decision after try number `tries` of `work` failed with `exc`: another try after a
    wait, or the failure recorded by the stage (`give_up`). Raises Stopped while the run stops."""
    if stop is not None and stop.is_set():
        raise Stopped from exc
    if isinstance(exc, RetriesSpent):
        settle(stage, work, exc.cause, exc.tries, db)
        return GaveUp(exc.cause)
    wait = policy.next_wait(exc, tries - 1, what=stage.describe(work))
    if wait is not None:
        # What `status` says the job waits for, from the first retry (best effort: the database
        # may be what is away).
        with contextlib.suppress(Exception):
            repo.note_waiting(
                db, stage.job_of(work), f"{stage.describe(work)}: {local_fault(exc) or describe(exc)}"
            )
        return Retry(wait, exc)
    settle(stage, work, exc, tries, db)
    return GaveUp(exc)


def settle(stage: Stage[W], work: W, exc: BaseException, tries: int, db: Database) -> None:
    """Record the last failure, unless the job has finished meanwhile (its rows stay as they are)."""
    state = repo.job_state(db, stage.job_of(work))
    if state is None or state[0] in FINISHED_JOB_STATUSES:
        return
    log.warning("%s: gave up after %d tries: %s", stage.describe(work), tries, describe(exc))
    stage.give_up(db, work, exc, tries)


def run_tries(
    stage: Stage[W],
    work: W,
    body: Callable[[], T],
    *,
    policy: RetryPolicy,
    db: Database,
    stop: threading.Event,
) -> T | None:
    """In this thread: try `body` until it succeeds (its value) or is given up (None); raises
    Stopped when the run stops, during a try or a wait."""
    for tries in itertools.count(1):
        try:
            return body()
        except Stopped:
            raise
        except Exception as exc:
            decision = after_failure(stage, work, exc, tries=tries, policy=policy, db=db, stop=stop)
            if isinstance(decision, GaveUp):
                return None
            if stop.wait(decision.wait):
                raise Stopped from exc
    raise AssertionError("unreachable")
