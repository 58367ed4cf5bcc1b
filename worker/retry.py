"""The one retry policy: which errors are worth another try, and how long to wait before it.

A transient error (a database, Redis or S3 that is down or slow, a timeout, a 5xx or a
throttle; storage.errors classifies, once) is never recorded as a unit's failure while tries
remain: the stage raises it, and whoever runs it tries again with exponential backoff and jitter.
`RetryPolicy.next_wait` is the one decision (another try or not, after how long; it counts and
logs the retry), applied three ways: `call` (the embedded driver and the stages' own database
reads and writes), `acall` (the LLM server engine's requests) and the Celery tasks' `retrying`
(worker.drivers.fleet.tasks), which hand the wait to Celery as the retry's countdown so that a worker
never sleeps holding a message. Only an error that retrying cannot fix (a bad image, a schema
violation), or the last try's, becomes a unit's error, with its real cause in the message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from storage.errors import describe, is_transient, local_fault
from worker import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["RetryPolicy", "describe", "failure_message", "is_transient"]


def failure_message(stage: str, exc: BaseException, tries: int) -> str:
    """What a stage's `give_up` records on its source or units: the real cause, and the tries when
    it was retried ("encode failed after 9 tries: ..."; a permanent error is tried once)."""
    after = f" after {tries} tries" if tries > 1 else ""
    return f"{stage} failed{after}: {describe(exc)}"


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 5
    backoff_base_s: float = 2.0
    backoff_max_s: float = 60.0

    def delay(self, attempt: int) -> float:
        """Seconds before try `attempt + 1` (attempt 0 is the first retry): exponential, jittered."""
        return min(self.backoff_max_s, self.backoff_base_s**attempt) * (0.5 + random.random())

    def next_wait(
        self,
        exc: BaseException,
        attempt: int,
        *,
        what: str,
        explain: Callable[[BaseException], str] = describe,
    ) -> float | None:
        """Seconds to wait before trying `what` again after `exc` failed try `attempt + 1`; None
        when it is not to be tried again (a permanent error, or the tries are spent): the caller
        then lets it fail. `explain` words the error for the log (never a secret)."""
        local = local_fault(exc)
        if local is not None:
            # Waited out, however long: freeing space or remounting heals it, and a source failed
            # for it would need a resume by hand. The operator hears it every try.
            wait = self.delay(attempt)
            metrics.RETRIES.labels(type(exc).__name__).inc()
            log.warning("%s: waiting: %s; trying again in %.1f s", what, local, wait)
            return wait
        if not is_transient(exc) or attempt >= self.max_retries:
            return None
        wait = self.delay(attempt)
        metrics.RETRIES.labels(type(exc).__name__).inc()
        log.warning("%s: %s; retrying in %.1f s (%d/%d)", what, explain(exc), wait, attempt + 1,
                    self.max_retries)  # fmt: skip
        return wait

    def tries_spent(self, exc: BaseException) -> int:
        """How many tries `call` made before it raised `exc` (unstopped): one for a permanent
        error, all of them for a transient one. What a driver's `give_up` reports."""
        return self.max_retries + 1 if is_transient(exc) else 1

    def call(self, fn: Callable[[], T], *, what: str, stop: threading.Event | None = None) -> T:
        """Run `fn`, retrying transient errors up to max_retries times; other errors, and the last
        transient one, propagate. `stop` cuts a backoff short (the run is being stopped)."""
        for attempt in itertools.count():
            try:
                return fn()
            except Exception as exc:
                wait = self.next_wait(exc, attempt, what=what)
                if wait is None or (stop is not None and stop.wait(wait)):
                    raise
                if stop is None:
                    time.sleep(wait)
        raise AssertionError("unreachable")

    async def acall(
        self, fn: Callable[[], Awaitable[T]], *, what: str, explain: Callable[[BaseException], str] = describe
    ) -> T:
        """`call` for a coroutine function: the backoff sleeps without holding the event loop."""
        for attempt in itertools.count():
            try:
                return await fn()
            except Exception as exc:
                wait = self.next_wait(exc, attempt, what=what, explain=explain)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")
