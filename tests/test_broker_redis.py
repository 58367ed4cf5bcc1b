"""worker/drivers/broker_redis.py: a Redis broker that restarts under a worker holding messages.

When the broker connection breaks, Celery (Consumer.on_connection_error_after_connected) first
`collect()`s the connection, which detaches its transport (`transport.client = None`), then
`close()`s it, which closes the channel that still holds the worker's unacknowledged messages and
puts them back in their queue. That is the state these tests build, on a real kombu connection
to a redis-server of the test's own: a message taken and not acknowledged, the transport
detached, the channel closed. With kombu's own transport the close raises AttributeError
'hostname' (seen in the fleet's outage test: Celery then exits the worker process); with
visbatch's, the message is back in its queue and nothing stays unacknowledged.
"""

from __future__ import annotations

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue

from tests.faults import RedisServer
from worker.drivers.broker_redis import TRANSPORT

pytestmark = pytest.mark.faults


def _hold_a_message_detached(server: RedisServer, transport: str) -> Connection:
    queue = Queue("q", Exchange("q", type="direct"), routing_key="q")
    connection = Connection(server.url, transport=transport)
    connection.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="q", declare=[queue])
    held = []
    callbacks = [lambda body, message: held.append(body)]
    consumer = Consumer(connection.default_channel, [queue], callbacks=callbacks)
    consumer.consume()
    connection.drain_events(timeout=5)
    assert held == [{"n": 1}]  # taken, not acknowledged
    connection.transport.client = None  # what collect() leaves (kombu Connection._do_close_transport)
    return connection


def test_a_message_held_across_a_broker_restart_is_back_in_its_queue(tmp_path):
    server = RedisServer(tmp_path / "broker")
    try:
        connection = _hold_a_message_detached(server, TRANSPORT)
        connection.default_channel.close()  # kombu's own transport raises AttributeError here
        client = redis.Redis.from_url(server.url)
        assert client.llen("q") == 1
        assert client.hlen("unacked") == 0
        client.close()
    finally:
        server.stop()


def test_kombus_own_transport_still_crashes_there(tmp_path):
    """The bug worker/drivers/broker_redis.py works around, as kombu has it today: when this fails,
    kombu has fixed it and visbatch's transport can go."""
    server = RedisServer(tmp_path / "broker")
    try:
        connection = _hold_a_message_detached(server, "redis")
        with pytest.raises(AttributeError, match="hostname"):
            connection.default_channel.close()
    finally:
        server.stop()
