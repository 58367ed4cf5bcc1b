"""A thread-pool worker takes every message after a RabbitMQ reconnect (issue 32).

After a reconnect Celery lowers the worker's prefetch count by the tasks still running and raises
it again as tasks are acknowledged, from the ack's promise. In a thread pool (visbatch's GPU
workers) that runs in the task's own thread: its synchronous basic.qos then read the consumer's
connection beside the worker's event loop (py-amqp is not thread-safe), and deliveries read there
were lost in the worker, unacknowledged, with no message left in the queue: a job waited for the
stall watch (187 s after a 3-s cut in tests/test_fleet_outages.py). The fleet's app turns that
reduction off (worker.drivers.fleet.celery_app).

A Celery worker of the fleet's app (its settings, the GPU workers' pool: threads, prefetch 1 per
thread), through a proxy that is cut while a task runs; afterwards every message sent to it must
be run. Probe tasks only: no model, no database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

pytestmark = [pytest.mark.fleet, pytest.mark.faults]

PROBE_APP = textwrap.dedent(
    """
    import os
    import time
    from pathlib import Path

    from visbatch.settings import Settings
    from worker.drivers.fleet.celery_app import make_celery

    app = make_celery(Settings())
    app.conf.include = []  # the probe tasks only: no model, no database, no stall watch
    OUT = Path(os.environ["PROBE_OUT"])


    @app.task(name="probe.hold")
    def hold(i, seconds):
        (OUT / f"hold-{i}").touch()
        time.sleep(seconds)


    @app.task(name="probe.mark")
    def mark(i):
        (OUT / f"mark-{i}").touch()
    """
)


HELD = 6  # of the worker's 8 threads


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s: {what}"
        time.sleep(0.05)


def test_a_thread_pool_worker_takes_every_message_after_a_rabbitmq_cut(tmp_path):
    from kombu.utils.url import url_to_parts

    from tests.faults import TCPProxy
    from tests.service_fixtures import DEFAULT_RABBITMQ_URL, _rabbitmq_unreachable_reason, _skip_or_fail
    from visbatch.settings import Settings
    from worker.drivers.fleet.celery_app import make_celery

    if (reason := _rabbitmq_unreachable_reason()) is not None:
        _skip_or_fail(reason, "set VISBATCH_TEST_RABBITMQ_URL")
    direct = os.environ.get("VISBATCH_TEST_RABBITMQ_URL", DEFAULT_RABBITMQ_URL)
    parts = url_to_parts(direct)
    proxy = TCPProxy(parts.port or 5672, parts.hostname or "127.0.0.1")
    vhost = parts.path or "/"
    prefix = f"visbatch-test-{uuid.uuid4().hex[:8]}:"
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "probe_app.py").write_text(PROBE_APP)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "VISBATCH_BROKER_URL": f"amqp://{parts.username}:{parts.password}@127.0.0.1:{proxy.port}/{vhost}",
        "VISBATCH_BROKER_PREFIX": prefix,
        "PROBE_OUT": str(out),
    }
    sender = make_celery(Settings(broker_url=direct, broker_prefix=prefix))  # not through the proxy
    log_path = tmp_path / "worker.log"
    argv = [sys.executable, "-m", "celery", "-A", "probe_app", "worker", "-P", "threads", "-c", "8",
            "--prefetch-multiplier", "1", "-Q", f"{prefix}ingest", "--without-gossip",
            "--without-mingle", "-l", "INFO"]  # fmt: skip
    with open(log_path, "w") as log:
        worker = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    logs = lambda: log_path.read_text(errors="replace")[-6000:]  # noqa: E731
    try:
        _wait_for(lambda: " ready." in log_path.read_text(), 60, "worker ready\n" + logs())
        # Tasks running through the cut: Celery lowers the prefetch count by as many, and raises
        # it again by one at each later ack, each time from the acknowledged task's thread.
        for i in range(HELD):
            sender.send_task("probe.hold", args=[i, 3])
        held = lambda: sum(1 for p in out.glob("hold-*"))  # noqa: E731
        _wait_for(lambda: held() == HELD, 30, "the held tasks started\n" + logs())
        proxy.outage(2)  # the tasks run on; their messages go back to the queue and come back
        _wait_for(lambda: log_path.read_text().count("Connected to amqp") >= 2, 60, "reconnect\n" + logs())
        sent = 0
        for _ in range(8):  # bursts, as ingest sends a chunk's encode messages, while those acks come
            for _ in range(10):
                sender.send_task("probe.mark", args=[sent])
                sent += 1
            time.sleep(1)
        done = lambda: sum(1 for p in out.glob("mark-*"))  # noqa: E731
        deadline = time.monotonic() + 20
        while done() < sent and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done() == sent, f"{sent - done()} of {sent} messages never ran after the reconnect\n{logs()}"
        # Read by two threads at once, the connection's frames were also torn apart
        # ("UnexpectedFrame: Received frame_end ..."): a second loss, the held messages redone.
        text = log_path.read_text(errors="replace")
        assert "UnexpectedFrame" not in text, logs()
        assert text.count("Connection to broker lost") == 1, logs()
        assert worker.poll() is None, logs()
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        proxy.close()
        with sender.connection_for_write() as conn:  # the probe's queue goes with the test
            conn.default_channel.queue_delete(f"{prefix}ingest")
