"""A broker reconnect is one WARNING line with its cause and what happens next (issue 32, item 6).

The records are the ones a worker logged in a Redis restart and a 3-s RabbitMQ cut (recorded on
this machine), made with Celery's and kombu's own message templates and exception types, and
handed to a handler that carries the filter, as `visbatch worker` installs it."""

from __future__ import annotations

import io
import logging
import warnings

import pytest
from amqp.exceptions import RecoverableConnectionError
from celery.exceptions import Reject
from celery.worker.consumer.consumer import CONNECTION_ERROR, CONNECTION_RETRY, CONNECTION_RETRY_STEP
from redis.exceptions import ConnectionError as RedisConnectionError

from worker.drivers.fleet.reconnect_logs import ReconnectLogs, install

URI = "worker.drivers.fleet.broker_redis:Transport://:**@127.0.0.1:6391/0"
REFUSED = RedisConnectionError("Error 111 connecting to 127.0.0.1:6391. Connection refused.")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logged():
    """(emit, lines, clock, filter): `emit(logger, level, msg, *args, exc_info=...)` logs through
    a handler with the filter; `lines()` is what it printed."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    clock = Clock()
    quiet = ReconnectLogs(clock=clock, verbose=lambda: False)
    handler.addFilter(quiet)

    def emit(name: str, level: int, msg: str, *args: object, exc_info: object = None) -> None:
        handler.handle(logging.LogRecord(name, level, __file__, 1, msg, args or None, exc_info))

    def lines() -> list[str]:
        return [line for line in stream.getvalue().splitlines() if line.strip()]

    return emit, lines, clock, quiet


def _nag() -> str:
    """Celery's deprecation note on each reconnect, as logging.captureWarnings logs it."""
    from celery.worker.consumer.consumer import CANCEL_TASKS_BY_DEFAULT

    return warnings.formatwarning(CANCEL_TASKS_BY_DEFAULT, PendingDeprecationWarning, "consumer.py", 427)


def _rejected(reason: str, requeue: bool) -> tuple:
    """A task's Reject as Celery's tracer logs it: a traceback whose cause chain runs through
    kombu's channel pool (the `IndexError: pop from empty list` of a Redis restart)."""
    try:
        try:
            try:
                [].pop()
            except IndexError as exc:
                raise REFUSED from exc
        except RedisConnectionError as exc:
            raise Reject(reason, requeue=requeue) from exc
    except Reject:
        import sys

        return sys.exc_info()


def test_a_redis_restart_is_one_warning_and_one_line_when_it_is_back(logged):
    emit, lines, clock, _ = logged
    consumer = "celery.worker.consumer.consumer"
    emit(
        consumer,
        logging.WARNING,
        "%s (%r)",
        CONNECTION_RETRY,
        RedisConnectionError("Connection closed by server."),
    )
    emit("kombu.transport.virtual.base", logging.INFO, "Restoring %r unacknowledged message(s)", 3)
    emit("py.warnings", logging.WARNING, "%s", _nag())
    emit(consumer, logging.INFO, "Skipping prefetch count reduction after connection restart because ...")
    for tries in (1, 2):
        clock.now += 2.0 * tries
        step = CONNECTION_RETRY_STEP.format(
            when=f"in {2.0 * tries:.2f} seconds", retries=tries, max_retries=100
        )
        emit(consumer, logging.ERROR, CONNECTION_ERROR, URI, REFUSED, step)
    emit("celery.app.trace", logging.WARNING, "Task %(name)s[%(id)s] %(exc)s",
         {"name": "visbatch.ingest_source", "id": "862b", "exc": "Reject(...)"},
         exc_info=_rejected("retry not published: OperationalError: Error 111", requeue=True))  # fmt: skip
    clock.now += 1.0
    emit("celery.worker.consumer.connection", logging.INFO, "Connected to %s", URI)

    assert lines() == [
        "WARNING celery.worker.consumer.consumer: broker connection lost (ConnectionError: Connection "
        "closed by server.): reconnecting; the messages this worker held go back to their queue and "
        "are redone (tasks are idempotent)",
        "WARNING celery.app.trace: Task visbatch.ingest_source[862b] handed back to the broker: retry not "
        "published: OperationalError: Error 111",
        "INFO celery.worker.consumer.connection: broker connection back after 7 s (2 failed tries; 3 "
        "unacknowledged message(s) returned)",
    ]
    assert "Traceback" not in "\n".join(lines()) and "IndexError" not in "\n".join(lines())


def test_a_rabbitmq_cut_with_acks_that_fail_after_it_is_one_warning(logged):
    emit, lines, clock, _ = logged
    lost = OSError("Server unexpectedly closed connection")
    closed = RecoverableConnectionError(None, "connection already closed", None, "")
    emit("celery.worker.consumer.consumer", logging.WARNING, "%s (%r)", CONNECTION_RETRY, lost)
    emit("py.warnings", logging.WARNING, "%s", _nag())
    emit("celery.worker.consumer.consumer", logging.INFO, "Temporarily reducing the prefetch count to 1 ...")
    clock.now += 3.0
    emit(
        "celery.worker.consumer.connection",
        logging.INFO,
        "Connected to %s",
        "amqp://guest:**@127.0.0.1:5672//",
    )
    # Tasks that started before the cut finish after it: their acks fail on the old channel, the
    # link flaps once more: the same episode.
    for tag in (4, 2):
        clock.now += 1.0
        emit("celery.worker.request", logging.CRITICAL, "Couldn't ack %r, reason:%r", tag, closed,
             exc_info=(RecoverableConnectionError, closed, None))  # fmt: skip
    emit("celery.worker.consumer.consumer", logging.WARNING, "%s (%r)", CONNECTION_RETRY, lost)
    emit("celery.worker.consumer.connection", logging.INFO, "Connected to %s", "amqp://...")
    emit(
        "celery.worker.consumer.consumer",
        logging.INFO,
        "Resuming normal operations following a restart.\n...",
    )

    assert lines() == [
        "WARNING celery.worker.consumer.consumer: broker connection lost (OSError: Server unexpectedly "
        "closed connection): reconnecting; the messages this worker held go back to their queue and are "
        "redone (tasks are idempotent)",
        "INFO celery.worker.consumer.connection: broker connection back after 3 s",
    ]


def test_a_failed_ack_first_opens_the_episode_and_says_what_happens_to_the_message(logged):
    emit, lines, _, _ = logged
    closed = RecoverableConnectionError(None, "connection already closed", None, "")
    emit("celery.worker.request", logging.CRITICAL, "Couldn't ack %r, reason:%r", 4, closed,
         exc_info=(RecoverableConnectionError, closed, None))  # fmt: skip
    (line,) = lines()
    assert line.startswith(
        "WARNING celery.worker.request: broker connection lost (RecoverableConnectionError:"
    )
    assert "the broker hands it out again and it is redone" in line


def test_a_long_outage_says_so_once_a_minute_and_a_new_one_later_is_new(logged):
    emit, lines, clock, quiet = logged
    consumer = "celery.worker.consumer.consumer"
    emit(consumer, logging.WARNING, "%s (%r)", CONNECTION_RETRY, REFUSED)
    for _ in range(40):  # 40 tries, 4 s apart: 2m40s away
        clock.now += 4.0
        emit(
            consumer, logging.ERROR, CONNECTION_ERROR, URI, REFUSED, "Trying again in 4.00 seconds... (1/100)"
        )
    emit("celery.worker.consumer.connection", logging.INFO, "Connected to %s", URI)
    shown = lines()
    assert len(shown) == 4, shown
    assert shown[1].startswith(
        "WARNING celery.worker.consumer.consumer: still no broker after 1m00s (15 failed"
    )
    assert shown[2].startswith(
        "WARNING celery.worker.consumer.consumer: still no broker after 2m00s (30 failed"
    )
    assert shown[3].endswith("broker connection back after 2m40s (40 failed tries)")

    clock.now += quiet.settle_s + 1  # settled: the next loss is news again
    emit(consumer, logging.WARNING, "%s (%r)", CONNECTION_RETRY, REFUSED)
    assert lines()[-1].startswith(
        "WARNING celery.worker.consumer.consumer: broker connection lost (ConnectionError"
    )


def test_a_broker_away_at_start_is_one_line_per_minute_not_three_per_try(logged):
    emit, lines, clock, _ = logged
    for tries in range(1, 4):
        clock.now += 2.0
        emit("celery.worker.consumer.consumer", logging.ERROR, CONNECTION_ERROR, URI, REFUSED,
             f"Trying again in 2.00 seconds... ({tries}/100)")  # fmt: skip
    emit("celery.worker.consumer.connection", logging.INFO, "Connected to %s", URI)
    assert lines() == [
        "WARNING celery.worker.consumer.consumer: cannot reach the broker (ConnectionError: Error 111 "
        "connecting to 127.0.0.1:6391. Connection refused.): retrying every few seconds",
        "INFO celery.worker.consumer.connection: broker connection back after 4 s (3 failed tries)",
    ]


def test_other_records_pass_as_they_are_and_verbose_keeps_the_quiet_ones_at_debug(logged):
    emit, lines, _, quiet = logged
    emit("celery.worker.consumer.connection", logging.INFO, "Connected to %s", URI)  # a start
    emit("kombu.transport.virtual.base", logging.INFO, "Restoring %r unacknowledged message(s)", 2)  # a stop
    emit("celery.worker.consumer.consumer", logging.ERROR, "consumer: some other error %s", "x")
    emit(
        "worker.retry",
        logging.WARNING,
        "visbatch.encode_units: OperationalError: ...; retrying in 1.3 s (1/8)",
    )
    assert lines() == [
        f"INFO celery.worker.consumer.connection: Connected to {URI}",
        "INFO kombu.transport.virtual.base: Restoring 2 unacknowledged message(s)",
        "ERROR celery.worker.consumer.consumer: consumer: some other error x",
        "WARNING worker.retry: visbatch.encode_units: OperationalError: ...; retrying in 1.3 s (1/8)",
    ]
    quiet.verbose = lambda: True
    emit("celery.worker.consumer.consumer", logging.WARNING, "%s (%r)", CONNECTION_RETRY, REFUSED)
    emit("kombu.transport.virtual.base", logging.INFO, "Restoring %r unacknowledged message(s)", 2)
    assert lines()[-1] == "DEBUG kombu.transport.virtual.base: Restoring 2 unacknowledged message(s)"


def test_a_warm_shutdowns_hand_back_is_one_line(logged):
    emit, lines, _, _ = logged
    emit("celery.app.trace", logging.WARNING, "Task %(name)s[%(id)s] %(exc)s",
         {"name": "visbatch.generate_units", "id": "84ed", "exc": "Reject(...)"},
         exc_info=_rejected("worker shutting down: the generate service stopped", requeue=True))  # fmt: skip
    assert lines() == [
        "WARNING celery.app.trace: Task visbatch.generate_units[84ed] handed back to the broker: worker "
        "shutting down: the generate service stopped"
    ]


def test_install_puts_one_filter_on_each_root_handler():
    root = logging.getLogger("visbatch-test-root")
    handlers = [logging.StreamHandler(io.StringIO()), logging.StreamHandler(io.StringIO())]
    for handler in handlers:
        root.addHandler(handler)
    try:
        first = install(root)
        assert install(root) is first  # twice is once
        assert all(handler.filters == [first] for handler in handlers)
    finally:
        for handler in handlers:
            root.removeHandler(handler)
