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
from functools import cache
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# S3 error codes that mean "try again later", not "this request is wrong".
_RETRYABLE_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
    }
)


@cache
def transient_types() -> tuple[type[BaseException], ...]:
    """Exception classes of a service that is down or slow (imported lazily: boto, redis, SQLAlchemy)."""
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
        botocore.exceptions.ConnectTimeoutError,
        ConnectionError,
        TimeoutError,
    )


def is_transient(exc: BaseException) -> bool:
    """True for an error that a later try may not meet (a service down, slow or throttling)."""
    if isinstance(exc, transient_types()):
        return True
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code in _RETRYABLE_S3_CODES or status >= 500
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def describe(exc: BaseException) -> str:
    """`Type: message`, on one line: what a unit's error says."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
                log.warning("%s: %s; retrying in %.1f s (%d/%d)", what, describe(exc), wait, attempt + 1,
                            self.max_retries)  # fmt: skip
                attempt += 1
                if stop is not None and stop.wait(wait):
                    raise
                if stop is None:
                    time.sleep(wait)
