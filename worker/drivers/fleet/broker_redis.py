"""The Redis broker transport of the fleet: kombu's own, surviving a broker restart.

When the Redis broker goes away while a worker holds messages, Celery drops the broken
connection in two steps (celery.worker.consumer.Consumer.on_connection_error_after_connected):
`Connection.collect()` detaches the transport (`transport.client = None`), then
`Connection.close()` closes the default channel, whose QoS puts the messages it holds back in
their queue through a fresh Redis client. kombu builds that client's parameters from
`transport.client`, which is None by then: AttributeError 'hostname' (kombu issues 582 and 970).
Celery reports an unrecoverable error and the worker process exits; the tasks it was running are
lost, and the messages it held come back only when the visibility timeout (100 s shipped) ends.

The channel here keeps the connection parameters it was built with and uses them once the
transport is detached. The restore then fails as what it is while the broker is still down (a
connection error, which Celery ignores while it reconnects; the messages wait for the
visibility timeout in the broker, as any unacknowledged message does) or succeeds once it is
back; and the tasks in flight finish and acknowledge their messages. `rediss://` and Sentinel
URLs keep kombu's transport (TLS and failover are chosen from the URL's scheme).

A dead worker's messages come back in seconds, not at the visibility timeout (issue 32). kombu
records each unacknowledged delivery (`unacked`, `unacked_index`) but not who holds it, so only
the timeout (100 s shipped; once 292 s on a loaded machine) could tell that its worker died. Here
each delivery also records its holder (`unacked_owner`: tag -> the worker's instance id,
worker.drivers.fleet.instance, the one its heartbeat and name carry), and
each consuming process keeps an alive key (`unacked_alive:<instance>`, expiring after ALIVE_S)
renewed from a thread of its own (a task that blocks the event loop never lets it lapse). Every
sweep a live worker already makes (`unacked_restore_interval`, 5 s) also hands back the
deliveries whose holder's alive key is gone: a SIGKILLed worker's messages are in their queue
again ALIVE_S to ALIVE_S + 5 s after the kill. A restore is kombu's own transaction, so a
delivery acknowledged meanwhile, or restored by two sweeps, is restored at most once.

An acknowledgement or a hand-back (a reject with requeue: a retry that could not be published)
that the broker did not take because it was away is kept (``_Unsettled``) and done again by the
next sweep once the broker is back: before, a handed-back message of a live worker waited in the
unacknowledged record for the visibility timeout (a job done 102 s after a 3-s Redis restart),
and a finished task's message was handed out and done again after it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import redis.exceptions
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps

from worker.drivers.fleet.instance import this_instance

log = logging.getLogger(__name__)

# Celery's `broker_transport` for a redis:// broker URL (worker.drivers.fleet.celery_app).
TRANSPORT = "worker.drivers.fleet.broker_redis:Transport"


ALIVE_S = 15  # three renewals missed (one every ALIVE_S / 3): the holder is gone


class _AliveKey:
    """This process's alive key, renewed every ALIVE_S / 3 from a daemon thread through the
    newest channel (a reconnect makes new channels; a renewal that fails is tried at the next)."""

    def __init__(self) -> None:
        self._channel: weakref.ref[Channel] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def follow(self, channel: Channel) -> None:
        with self._lock:
            self._channel = weakref.ref(channel)
            if self._thread is None:
                self._thread = threading.Thread(target=self._renew, name="broker-alive", daemon=True)
                self._thread.start()
        self.renew()

    def renew(self) -> None:
        channel = self._channel() if self._channel is not None else None
        if channel is None:
            return
        try:
            # A pooled client, never `channel.client`: that one's single connection is the one the
            # event loop blocks in BRPOP on, and two users of it read each other's replies.
            with channel.conn_or_acquire() as client:
                client.set(alive_key(channel, this_instance()), "1", ex=ALIVE_S)
        except Exception as exc:  # noqa: BLE001 - the broker is away: the next renewal tries again
            log.debug("could not renew this worker's alive key: %s", exc)

    def _renew(self) -> None:
        while True:
            time.sleep(ALIVE_S / 3)
            self.renew()


_ALIVE = _AliveKey()


def _new_process() -> None:
    """A forked child (a prefork pool's) is another holder (worker.drivers.fleet.instance gives it its own
    id) with its own renewals, never the parent's (which must lapse when the parent dies)."""
    global _ALIVE, _UNSETTLED
    _ALIVE = _AliveKey()
    _UNSETTLED = _Unsettled()


os.register_at_fork(after_in_child=_new_process)


# What a broker that went away fails with; OSError covers a socket torn mid-command.
_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class _Unsettled:
    """This process's acknowledgements and hand-backs that the broker did not take (delivery tag
    -> requeue), settled by the next sweep of a live channel (QoS.settle). Process-wide: the
    channel that took the delivery is dead by then, and a new one makes the sweeps."""

    def __init__(self) -> None:
        self._tags: dict[str, bool] = {}
        self._lock = threading.Lock()

    def add(self, delivery_tag: str, requeue: bool) -> None:
        with self._lock:
            self._tags[delivery_tag] = requeue

    def pending(self) -> dict[str, bool]:
        with self._lock:
            return dict(self._tags)

    def done(self, delivery_tag: str) -> None:
        with self._lock:
            self._tags.pop(delivery_tag, None)


_UNSETTLED = _Unsettled()


def owner_key(channel: Any) -> str:
    return f"{channel.unacked_key}_owner"


def alive_key(channel: Any, instance: str) -> str:
    return f"{channel.unacked_key}_alive:{instance}"


class QoS(kombu_redis.QoS):
    """kombu's QoS, with each delivery's holder recorded and a dead holder's deliveries restored."""

    def append(self, message: Any, delivery_tag: str) -> None:
        # kombu's own append, with the holder written in the same pipeline (no window in which a
        # delivery is recorded without its holder).
        delivery = message.delivery_info
        entry = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(
                self.unacked_key, delivery_tag, entry
            ).hset(owner_key(self.channel), delivery_tag, this_instance()).execute()
            virtual.QoS.append(self, message, delivery_tag)

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        return super()._remove_from_indices(delivery_tag, pipe).hdel(owner_key(self.channel), delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        try:
            super().ack(delivery_tag)
        except _CONNECTION_ERRORS:
            _UNSETTLED.add(delivery_tag, requeue=False)
            raise

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except _CONNECTION_ERRORS:
            _UNSETTLED.add(delivery_tag, requeue=requeue)
            raise

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        self.settle()
        super().restore_visible(start, num, interval)
        self.restore_orphans()

    def settle(self) -> int:
        """Do again the acknowledgements and hand-backs the broker did not take; how many were
        done. A restore or a removal that already happened is not done twice: a tag no longer
        recorded is restored as nothing, and removing it again changes nothing."""
        settled = 0
        for tag, requeue in _UNSETTLED.pending().items():
            try:
                if requeue:
                    self.restore_by_tag(tag, leftmost=True)
                else:
                    self._remove_from_indices(tag).execute()
            except _CONNECTION_ERRORS:
                return settled  # still away: the next sweep tries again
            _UNSETTLED.done(tag)
            settled += 1
        if settled:
            log.info("broker back: %d acknowledgement(s) or hand-back(s) it missed made now", settled)
        return settled

    def restore_orphans(self) -> int:
        """Hand back the deliveries whose holder's alive key is gone; how many."""
        prefix = self.channel.global_keyprefix
        with self.channel.conn_or_acquire() as client:
            # HGETALL and MGET are not among the commands kombu's client prefixes: prefix them here.
            owners = {
                bytes_to_str(tag): bytes_to_str(who)
                for tag, who in client.hgetall(prefix + owner_key(self.channel)).items()
            }
            if not owners:
                return 0
            instances = sorted(set(owners.values()))
            keys = [prefix + alive_key(self.channel, i) for i in instances]
            alive = {i for i, here in zip(instances, client.mget(keys), strict=True) if here}
            gone = [tag for tag, who in owners.items() if who not in alive]
            for tag in gone:
                self.restore_by_tag(tag, client)
        if gone:
            holders = sorted({owners[tag] for tag in gone})
            log.warning(
                "broker: %d message(s) of worker(s) %s that stopped renewing handed back to their queues",
                len(gone),
                ", ".join(holders),
            )
        return len(gone)


class Channel(kombu_redis.Channel):
    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._own_connparams: dict[bool, dict[str, Any]] = {}
        super().__init__(*args, **kwargs)
        for asynchronous in (False, True):  # both kinds of client, while the transport is attached
            self._connparams(asynchronous=asynchronous)
        _ALIVE.follow(self)

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None and asynchronous in self._own_connparams:
            return dict(self._own_connparams[asynchronous])  # detached: what this channel was built with
        params = super()._connparams(asynchronous=asynchronous)
        self._own_connparams[asynchronous] = dict(params)
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel
