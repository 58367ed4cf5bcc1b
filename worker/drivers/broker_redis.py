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
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis

# Celery's `broker_transport` for a redis:// broker URL (worker.drivers.celery_app).
TRANSPORT = "worker.drivers.broker_redis:Transport"


class Channel(kombu_redis.Channel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._own_connparams: dict[bool, dict[str, Any]] = {}
        super().__init__(*args, **kwargs)
        for asynchronous in (False, True):  # both kinds of client, while the transport is attached
            self._connparams(asynchronous=asynchronous)

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None and asynchronous in self._own_connparams:
            return dict(self._own_connparams[asynchronous])  # detached: what this channel was built with
        params = super()._connparams(asynchronous=asynchronous)
        self._own_connparams[asynchronous] = dict(params)
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel
