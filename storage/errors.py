"""Which errors may pass: the one classification every retry in visbatch uses.

A transient error is a service that is down, slow or throttling (the database, Redis, an S3 API,
the LLM server; a timeout, a 5xx, a 429, SlowDown), never an answer about the request itself
(400, 403, 404, 412, a bad image, a schema violation). worker.retry retries the first kind with
backoff; the drop folder leaves an object for the next poll on them.
"""

from __future__ import annotations

import errno
from functools import cache


class TransientFault(RuntimeError):
    """A fault of visbatch's own machinery that a fresh try does not meet (a helper process out of
    step, killed and restarted): retried like a service that was down, never a unit's failure."""


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
        "500",
        "502",
        "503",
        "504",
    }
)


# HTTP statuses of a server that is down, overloaded or throttling (besides every 5xx).
_RETRYABLE_HTTP_STATUSES = frozenset({408, 429})


@cache
def transient_types() -> tuple[type[BaseException], ...]:
    """Exception classes of a service that is down or slow (imported lazily: boto, redis, ...)."""
    import botocore.exceptions
    import httpx
    import redis.exceptions
    import sqlalchemy.exc

    return (
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        botocore.exceptions.ConnectionError,  # endpoint unreachable, connection closed, timeouts
        botocore.exceptions.HTTPClientError,
        # The LLM server (worker.engines.openai_engine): unreachable, reset, or too slow. Not every
        # httpx.TransportError: a bad URL scheme or a malformed request will not heal on a retry.
        httpx.TimeoutException,
        httpx.NetworkError,
        httpx.RemoteProtocolError,
        ConnectionError,
        TimeoutError,
    )


# A machine's own storage that is full or read-only (the page store, the cache folder, a work
# folder): an operator frees space or remounts, and the work goes on where it was. Waited out,
# however long it takes (worker.retry), never a source's or a unit's failure.
_LOCAL_FAULTS = {errno.ENOSPC: "full", errno.EDQUOT: "over its quota", errno.EROFS: "read-only"}


def local_fault(exc: BaseException) -> str | None:
    """ "the disk is full (/data/store)" for a full or read-only filesystem; None otherwise."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _LOCAL_FAULTS:
            where = f" ({exc.filename})" if exc.filename else ""
            return f"the disk is {_LOCAL_FAULTS[exc.errno]}{where}"
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def is_transient(exc: BaseException) -> bool:
    """True for an error that a later try may not meet (a service down, slow or throttling, a
    full or read-only disk)."""
    if isinstance(exc, (TransientFault, *transient_types())):
        return True
    if local_fault(exc) is not None:
        return True
    import sqlalchemy.exc

    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
        return True
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _RETRYABLE_S3_CODES or (isinstance(status, int) and status >= 500)
    status = getattr(response, "status_code", None)  # httpx.HTTPStatusError
    if isinstance(status, int):
        return status >= 500 or status in _RETRYABLE_HTTP_STATUSES
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def describe(exc: BaseException) -> str:
    """`Type: message`, on one line: what a unit's error says."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
