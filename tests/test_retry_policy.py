"""worker.retry: one decision (`next_wait`) applied by every driver: the embedded run and stages
(`call`), the LLM server engine (`acall`) and the Celery tasks (worker.drivers.fleet.tasks.retrying,
tested with a real Celery app in test_retry_publish.py). No service is needed: the errors are
the real classes storage.errors classifies."""

from __future__ import annotations

import asyncio
import threading

import pytest
import sqlalchemy.exc

from worker.retry import RetryPolicy

QUICK = RetryPolicy(max_retries=2, backoff_base_s=0.001, backoff_max_s=0.001)


def _database_away() -> Exception:
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))


def _flaky(failures: list[Exception], answer: str = "ok"):
    calls = []

    def fn() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return answer

    return fn, calls


def test_next_wait_retries_transient_errors_until_the_tries_are_spent(caplog):
    caplog.set_level("WARNING", logger="worker.retry")
    assert QUICK.next_wait(_database_away(), 0, what="reading answers") is not None
    assert QUICK.next_wait(_database_away(), 1, what="reading answers") is not None
    assert QUICK.next_wait(_database_away(), 2, what="reading answers") is None  # spent
    assert QUICK.next_wait(ValueError("a bad image"), 0, what="encode") is None  # permanent
    assert "reading answers: " in caplog.text and "retrying in" in caplog.text and "(2/2)" in caplog.text


def test_call_and_acall_apply_the_same_decision():
    fn, calls = _flaky([_database_away(), _database_away()])
    assert QUICK.call(fn, what="x") == "ok" and len(calls) == 3

    fn, calls = _flaky([_database_away()] * 3)
    with pytest.raises(sqlalchemy.exc.OperationalError):
        QUICK.call(fn, what="x")
    assert len(calls) == 3  # the first try and max_retries more

    fn, calls = _flaky([ValueError("a bad image")])
    with pytest.raises(ValueError):
        QUICK.call(fn, what="x")
    assert len(calls) == 1  # never retried

    failures = [_database_away(), _database_away()]

    async def afn() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    assert asyncio.run(QUICK.acall(afn, what="x")) == "ok" and not failures


def test_a_stop_cuts_the_backoff_short():
    slow = RetryPolicy(max_retries=5, backoff_base_s=60, backoff_max_s=60)
    stop = threading.Event()
    stop.set()
    fn, calls = _flaky([_database_away()] * 5)
    with pytest.raises(sqlalchemy.exc.OperationalError):
        slow.call(fn, what="x", stop=stop)  # would wait 30-90 s without the stop
    assert len(calls) == 1
