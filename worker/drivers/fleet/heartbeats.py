"""Each fleet worker's identity and its heartbeat entry: what `visbatch workers` lists, and what
`submit`, `status` and the stall watch count as a queue's consumers (worker.drivers.fleet.consumers).

Why an instance id and not pid@host: in a container a worker is pid 1 of its own PID namespace,
and containers (or hosts with host networking) share a host name, so two workers had one name,
one heartbeat, and the warm stop of one took the other's entry away. Each worker process has a
short random id, made when it starts (worker.drivers.fleet.instance); its Celery node name, its
heartbeat and its entry in each queue's consumers carry it. A restarted worker process (the
supervisor's child) is a new instance: the entry of the one that died ages out instead of being
taken over.

The entry is JSON (host, instance, node name, queues, pid, metrics port, started at, the jobs of
the tasks in hand, the beat's time), written by the stall-watch thread every ~30 s and at once at
start, taken out on a warm shutdown, counted as gone once FRESH_S old (a worker killed outright):

- Redis: one key per worker, `<prefix>visbatch.worker.<instance>`, that expires FRESH_S after its
  last beat, beside its member in each of its queues' consumer sets (consumers.py);
- RabbitMQ: nothing in AMQP lists what a worker wrote, so the beats are appended to a stream,
  `<prefix>visbatch.workers` (RabbitMQ 3.9+; kept an hour, in 1 MB segments), read without taking
  anything from it: the newest beat of each instance in the last FRESH_S seconds, unless a later
  "gone" record says it stopped. (The queues' consumer counts come from RabbitMQ itself.)

No Celery here, nor any other driver: `visbatch workers` imports this module and the broker's
client, and worker.drivers.fleet.consumers counts the queues' consumers from what is written here.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from visbatch.settings import Settings

# A worker beats every stall_check_s (30 s, jittered up to 1.5x): three beats may be missed before
# it counts as gone.
FRESH_S = 135.0

# The stream of beats on RabbitMQ: long enough to cover FRESH_S many times over, in segments small
# enough that retention (which drops whole segments) keeps it small.
STREAM_ARGUMENTS = {
    "x-queue-type": "stream",
    "x-max-age": "1h",
    "x-stream-max-segment-size-bytes": 1_000_000,
}
# The stage queues (celery_app.QUEUES, not imported: that module builds the Celery app).
STAGES = ("ingest", "encode", "generate")
# Reading the stream: how long to wait for its first beat, then for the next one (it sends what
# it holds at once; it never says that it has no more).
_FIRST_BEAT_S = 1.5
_NEXT_BEAT_S = 0.3


@dataclass(frozen=True, slots=True)
class WorkerCard:
    """What a worker says about itself in each heartbeat."""

    instance: str
    host: str
    queues: tuple[str, ...]
    pid: int
    started_at: str  # ISO 8601, UTC
    name: str = ""  # the Celery node name (visbatch-<queues>-<instance>@<host> unless --name)
    metrics_port: int | None = None
    jobs: tuple[str, ...] = ()  # the jobs of the tasks it runs now (as of beat_at)
    beat_at: str = ""  # ISO 8601, UTC; set by each beat
    gone: bool = field(default=False)  # a warm shutdown's last word (RabbitMQ's stream)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerCard:
        data = json.loads(raw)
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        for name in ("queues", "jobs"):
            known[name] = tuple(known.get(name) or ())
        return cls(**known)

    def beat_time(self) -> datetime | None:
        try:
            return datetime.fromisoformat(self.beat_at)
        except ValueError:
            return None


def _now() -> datetime:
    return datetime.now(UTC)


def card_for_this_process(
    instance: str, queues: Sequence[str], *, name: str = "", metrics_port: int | None = None
) -> WorkerCard:
    return WorkerCard(
        instance=instance,
        host=socket.gethostname(),
        queues=tuple(queues),
        pid=os.getpid(),
        started_at=_now().isoformat(timespec="seconds"),
        name=name,
        metrics_port=metrics_port,
    )


# The card of this worker process, made by `visbatch worker` before Celery starts; the stall
# watch completes it (node name, queues) when the worker is ready and beats it.
_THIS: WorkerCard | None = None


def set_this_worker(card: WorkerCard) -> None:
    global _THIS
    _THIS = card


def this_worker() -> WorkerCard | None:
    return _THIS


# --- writing ------------------------------------------------------------------------------------


def is_redis(url: str) -> bool:
    return url.split("://", 1)[0] in ("redis", "rediss")


def consumers_key(settings: Settings, stage: str) -> str:
    """The sorted set of the workers consuming a stage's queue (Redis), under the fleet's prefix:
    what worker.drivers.fleet.consumers counts."""
    return f"{settings.broker_prefix}visbatch.consumers.{stage}"


def add_consumer(pipe: Any, settings: Settings, worker: str, stages: Iterable[str]) -> None:
    """Queue on a Redis pipeline: `worker` consumes these stages' queues as of now."""
    now = time.time()
    for stage in stages:
        key = consumers_key(settings, stage)
        pipe.zadd(key, {worker: now})
        pipe.zremrangebyscore(key, "-inf", now - FRESH_S)  # workers that died without a word
        pipe.expire(key, int(FRESH_S * 2))  # a fleet that is gone leaves nothing behind


def worker_key(settings: Settings, instance: str) -> str:
    """A worker's entry on Redis (under the fleet's prefix)."""
    return f"{settings.broker_prefix}visbatch.worker.{instance}"


def stream_name(settings: Settings) -> str:
    """The stream of the fleet's beats on RabbitMQ (queue names carry the fleet's prefix)."""
    return f"{settings.broker_prefix}visbatch.workers"


def beat(settings: Settings, card: WorkerCard, *, timeout: float = 2.0) -> WorkerCard:
    """Write `card` as this worker's heartbeat now (both brokers); returns what was written."""
    card = replace(card, beat_at=_now().isoformat(timespec="milliseconds"), gone=False)
    if is_redis(settings.broker_url):
        client = _redis(settings, timeout)
        try:
            pipe = client.pipeline(transaction=False)
            add_consumer(pipe, settings, card.instance, card.queues)
            pipe.set(worker_key(settings, card.instance), card.to_json(), ex=int(FRESH_S))
            pipe.execute()
        finally:
            client.close()
    else:
        _publish(settings, card, timeout)
    return card


def withdraw(settings: Settings, card: WorkerCard, *, timeout: float = 2.0) -> None:
    """Take this worker out of the live ones (a warm shutdown): its queues' consumers and its
    entry; only its own, whoever shares its pid and host name."""
    if is_redis(settings.broker_url):
        client = _redis(settings, timeout)
        try:
            pipe = client.pipeline(transaction=False)
            for stage in card.queues:
                pipe.zrem(consumers_key(settings, stage), card.instance)
            pipe.delete(worker_key(settings, card.instance))
            pipe.execute()
        finally:
            client.close()
    else:
        last = replace(card, beat_at=_now().isoformat(timespec="milliseconds"), gone=True)
        _publish(settings, last, timeout)


def _redis(settings: Settings, timeout: float) -> Any:
    import redis

    return redis.Redis.from_url(settings.broker_url, socket_timeout=timeout, socket_connect_timeout=timeout)


def _amqp(settings: Settings, timeout: float) -> Any:
    from kombu import Connection

    conn = Connection(settings.broker_url, connect_timeout=timeout)
    # One quick try: no pause between retries (kombu waits 2 s by default).
    conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, interval_max=0, timeout=timeout)
    return conn


def _publish(settings: Settings, card: WorkerCard, timeout: float) -> None:
    with _amqp(settings, timeout) as conn, conn.channel() as channel:
        name = stream_name(settings)
        channel.queue_declare(queue=name, durable=True, auto_delete=False, arguments=STREAM_ARGUMENTS)
        message = channel.prepare_message(card.to_json().encode(), content_type="application/json")
        channel.basic_publish(message, exchange="", routing_key=name)


# --- reading ------------------------------------------------------------------------------------


def live_workers(settings: Settings, *, timeout: float = 2.0) -> list[WorkerCard]:
    """The workers whose last beat is under FRESH_S old, by host then start. Raises the broker
    client's error when the broker cannot be reached (the caller says so)."""
    if is_redis(settings.broker_url):
        cards = _redis_cards(settings, timeout)
    else:
        cards = _stream_cards(settings, timeout)
    fresh = _now() - timedelta(seconds=FRESH_S)
    live = [c for c in cards if not c.gone and (c.beat_time() or fresh) > fresh]
    return sorted(live, key=lambda c: (c.host, c.started_at, c.instance))


def _redis_cards(settings: Settings, timeout: float) -> list[WorkerCard]:
    client = _redis(settings, timeout)
    try:
        pipe = client.pipeline(transaction=False)
        for stage in STAGES:
            pipe.zrangebyscore(consumers_key(settings, stage), time.time() - FRESH_S, "+inf")
        instances = sorted({m.decode() if isinstance(m, bytes) else m for ms in pipe.execute() for m in ms})
        raw = client.mget([worker_key(settings, i) for i in instances]) if instances else []
    finally:
        client.close()
    return list(_parsed(r for r in raw if r is not None))


def _stream_cards(settings: Settings, timeout: float) -> list[WorkerCard]:
    received: list[bytes] = []
    since = _now() - timedelta(seconds=FRESH_S + 5)  # the stream finds a beat by its chunk's time
    with _amqp(settings, timeout) as conn:
        with conn.channel() as probe:
            try:
                probe.queue_declare(queue=stream_name(settings), passive=True)
            except Exception as exc:
                if "NOT_FOUND" not in str(exc) and "404" not in str(exc):
                    raise
                return []  # no worker ever beat on this fleet
        channel = conn.channel()
        channel.basic_qos(0, 500, False)  # a stream is only read with a prefetch and acks

        def take(message: Any) -> None:
            received.append(message.body)
            channel.basic_ack(message.delivery_tag)

        channel.basic_consume(stream_name(settings), callback=take, arguments={"x-stream-offset": since})
        deadline = time.monotonic() + max(timeout, _FIRST_BEAT_S) * 2
        wait = _FIRST_BEAT_S
        while time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=wait)
            except TimeoutError:  # socket.timeout: nothing more for now
                break
            wait = _NEXT_BEAT_S
    latest: dict[str, WorkerCard] = {}
    for card in _parsed(received):
        if card.instance not in latest or card.beat_at >= latest[card.instance].beat_at:
            latest[card.instance] = card
    return list(latest.values())


def _parsed(raws: Iterable[str | bytes]) -> Iterable[WorkerCard]:
    for raw in raws:
        try:
            yield WorkerCard.from_json(raw)
        except (ValueError, TypeError):  # not ours, or an older worker's: not listed
            continue
