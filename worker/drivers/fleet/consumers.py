"""Which stage queues have a worker consuming them, and how many messages wait in each: what
`visbatch submit` warns about, what `visbatch status` says, and what the stall watch asks before it
calls a job stuck. On Redis also which jobs the workers hold messages of (`held_jobs`): with the
queues, every message a job has, so the stall watch can tell a lost one in seconds.

RabbitMQ knows its consumers: a passive queue declare answers with the queue's message and
consumer counts in one round trip. Redis has none to ask (workers poll its lists), and Celery's
broadcast `inspect` costs its whole timeout and goes unanswered by a worker busy in a solo pool; so
on Redis each worker announces the queues it consumes (a sorted set per queue in the broker Redis,
member = the worker's instance id, score = its last heartbeat; worker.drivers.fleet.heartbeats), from the
thread that looks for stalled jobs (worker.drivers.fleet.stall_watch), and takes itself out on a warm
shutdown. A worker killed outright drops out once its heartbeat is FRESH_S old.

Every call here is bounded by a timeout of about a second and answers None when the broker cannot
tell: a warning that cannot be given is left out, never a submit slowed or failed (a broker that is
down already fails the submit itself).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from visbatch.settings import Settings

# The consumer sets and their freshness are the heartbeats' (which import nothing of the drivers).
from worker.drivers.fleet.heartbeats import FRESH_S, add_consumer, consumers_key, is_redis

# Kombu's Redis transport keeps one list per priority step: the queue's name, then name + sep + step.
_REDIS_PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")


@dataclass(frozen=True, slots=True)
class QueueState:
    messages: int  # waiting to be taken (not counting those a worker holds unacknowledged)
    consumers: int  # workers consuming it (Redis: workers whose heartbeat is fresh)


def _redis(settings: Settings, timeout: float) -> Any:
    import redis

    return redis.Redis.from_url(settings.broker_url, socket_timeout=timeout, socket_connect_timeout=timeout)


def queue_states(
    settings: Settings, stages: Sequence[str], *, timeout: float = 1.0
) -> dict[str, QueueState] | None:
    """Messages waiting and consumers of each stage's queue; None when the broker cannot tell
    (unreachable within `timeout`, or a transport this does not know)."""
    from worker.drivers.fleet.queues import is_amqp

    try:
        if is_redis(settings.broker_url):
            return _redis_states(settings, stages, timeout)
        if is_amqp(settings.broker_url):
            return _amqp_states(settings, stages, timeout)
    except Exception:  # noqa: BLE001 - unknown is an answer here; the caller says nothing
        return None
    return None


def _redis_states(settings: Settings, stages: Sequence[str], timeout: float) -> dict[str, QueueState]:
    client = _redis(settings, timeout)
    try:
        pipe = client.pipeline(transaction=False)
        fresh = time.time() - FRESH_S
        for stage in stages:
            for suffix in _REDIS_PRIORITY_SUFFIXES:
                pipe.llen(f"{settings.broker_prefix}{stage}{suffix}")
            pipe.zcount(consumers_key(settings, stage), fresh, "+inf")
        replies = pipe.execute()
    finally:
        client.close()
    step = len(_REDIS_PRIORITY_SUFFIXES) + 1
    return {
        stage: QueueState(
            sum(int(n) for n in replies[i * step : (i + 1) * step - 1]), int(replies[(i + 1) * step - 1])
        )
        for i, stage in enumerate(stages)
    }


def _amqp_states(settings: Settings, stages: Sequence[str], timeout: float) -> dict[str, QueueState]:
    from kombu import Connection

    from worker.drivers.fleet.queues import queue_name

    states: dict[str, QueueState] = {}
    with Connection(settings.broker_url, connect_timeout=timeout) as conn:
        # One quick try: no pause between retries (kombu waits 2 s by default).
        conn.ensure_connection(
            max_retries=1, interval_start=0, interval_step=0, interval_max=0, timeout=timeout
        )
        for stage in stages:
            # A fresh channel per queue: AMQP closes a channel whose passive declare fails.
            with conn.channel() as channel:
                try:
                    ok = channel.queue_declare(queue=queue_name(settings, stage), passive=True)
                except Exception as exc:
                    if "NOT_FOUND" not in str(exc) and "404" not in str(exc):
                        raise
                    states[stage] = QueueState(0, 0)  # never declared: nobody ever consumed it
                else:
                    states[stage] = QueueState(int(ok.message_count), int(ok.consumer_count))
    return states


def held_jobs(settings: Settings, *, timeout: float = 5.0) -> set[str] | None:
    """The jobs whose messages workers hold unacknowledged (Redis: kombu's `unacked` hash, every
    delivery taken and not yet acknowledged, running or prefetched); None where the broker cannot
    tell: RabbitMQ (it lists no unacknowledged message), no answer within `timeout`, or a held
    message that does not read as a stage task (it might be any job's)."""
    if not is_redis(settings.broker_url):
        return None
    try:
        client = _redis(settings, timeout)
        try:
            entries = client.hvals(f"{settings.broker_prefix}unacked")
        finally:
            client.close()
        return {_job_of(entry) for entry in entries}
    except Exception:  # noqa: BLE001 - unknown is an answer here; the stall watch waits longer
        return None


def _job_of(entry: bytes) -> str:
    """The job of one held delivery, as kombu's Redis QoS records it: JSON [message, exchange,
    routing key], the message's body (base64 by default) Celery's protocol 2, [args, kwargs,
    embed], and every stage task's first argument its job id."""
    message = json.loads(entry)[0]
    body = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args = json.loads(body)[0]
    if not args or not isinstance(args[0], str):
        raise ValueError("not a stage task's message")
    return args[0]


def queue_depths(settings: Settings, stages: Sequence[str]) -> dict[str, int]:
    """Messages waiting in each stage's queue, for the metrics' queue-depth gauge (scrape time)."""
    states = queue_states(settings, stages)
    if states is None:
        raise ConnectionError("the broker did not answer")  # the collector logs it, no sample
    return {stage: state.messages for stage, state in states.items()}


def stages_without_consumer(
    settings: Settings, stages: Sequence[str], *, timeout: float = 1.0
) -> list[str] | None:
    """The stages among `stages` whose queue no worker consumes; None when the broker cannot tell."""
    states = queue_states(settings, stages, timeout=timeout)
    if states is None:
        return None
    return [stage for stage in stages if states[stage].consumers == 0]


def announce(settings: Settings, worker: str, stages: Iterable[str], *, timeout: float = 2.0) -> None:
    """Say (Redis) that `worker` consumes these stages' queues now; RabbitMQ needs no word."""
    if not is_redis(settings.broker_url):
        return
    client = _redis(settings, timeout)
    try:
        pipe = client.pipeline(transaction=False)
        add_consumer(pipe, settings, worker, stages)
        pipe.execute()
    finally:
        client.close()


def withdraw(settings: Settings, worker: str, stages: Iterable[str], *, timeout: float = 2.0) -> None:
    """Take `worker` out of its queues' consumers (Redis) on a warm shutdown."""
    if not is_redis(settings.broker_url):
        return
    client = _redis(settings, timeout)
    try:
        pipe = client.pipeline(transaction=False)
        for stage in stages:
            pipe.zrem(consumers_key(settings, stage), worker)
        pipe.execute()
    finally:
        client.close()


def start_hint(stages: Sequence[str]) -> str:
    """The command that starts a worker for these stages."""
    return f"start one: visbatch worker --queues {','.join(stages)}"
