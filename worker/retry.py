"""The one retry policy: which errors are worth another try, and how long to wait before it.

A transient error (a database, Redis or S3 that is down or slow, a timeout, a 5xx or a
throttle) is never recorded as a unit's failure while tries remain: the stage raises it, and
the driver tries again with exponential backoff and jitter (the Celery tasks through Celery's
autoretry, the embedded run through `RetryPolicy.call`). Only an error that retrying cannot fix
(a bad image, a schema violation), or the last try's, becomes a unit's error, with its real
cause in the message.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from storage.errors import describe, is_transient
from worker import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["RetryPolicy", "describe", "is_transient"]


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 5
    backoff_base_s: float = 2.0
    backoff_max_s: float = 60.0

    def delay(self, attempt: int) -> float:
        """Seconds before try `attempt + 1` (attempt 0 is the first retry): exponential, jittered."""
        return min(self.backoff_max_s, self.backoff_base_s**attempt) * (0.5 + random.random())

    def call(self, fn: Callable[[], T], *, what: str, stop: threading.Event | None = None) -> T:
        """Run `fn`, retrying transient errors up to max_retries times; other errors, and the last
        transient one, propagate. `stop` cuts a backoff short (the run is being stopped)."""
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                if not is_transient(exc) or attempt >= self.max_retries:
                    raise
                wait = self.delay(attempt)
                metrics.RETRIES.labels(type(exc).__name__).inc()
                log.warning("%s: %s; retrying in %.1f s (%d/%d)", what, describe(exc), wait, attempt + 1,
                            self.max_retries)  # fmt: skip
                attempt += 1
                if stop is not None and stop.wait(wait):
                    raise
                if stop is None:
                    time.sleep(wait)
