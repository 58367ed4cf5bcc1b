"""Each fleet worker its own identity (issue 32): two workers under one pid and one host name (two
containers whose worker is pid 1, under a shared host name) are two heartbeats, and the warm stop
of one takes only its own entry away, on both brokers; `visbatch workers` lists them.

Fast: the heartbeats are written as the workers' stall-watch thread writes them, on the real
Redis and RabbitMQ, without starting a worker (tests/test_worker_identity_fleet.py starts real
ones in their own PID and UTS namespaces)."""

from __future__ import annotations

import io
import json
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console
from typer.testing import CliRunner

from visbatch.settings import Settings
from worker.cli.exits import EXIT_UNAVAILABLE
from worker.cli.main import app
from worker.cli.workers import shown_duration, worker_records, workers_table
from worker.drivers.fleet import heartbeats
from worker.drivers.fleet.consumers import queue_states
from worker.drivers.fleet.heartbeats import WorkerCard

JOB = "3f2a9c01" + "0" * 24


def _twins() -> tuple[WorkerCard, WorkerCard]:
    """Two workers as two containers make them: pid 1 each, one host name, their own instance."""
    # Two workers' cards made here, each with its own instance (a worker process has one).
    one = heartbeats.card_for_this_process(uuid.uuid4().hex[:12], ["ingest"], metrics_port=9808)
    two = heartbeats.card_for_this_process(uuid.uuid4().hex[:12], ["ingest", "encode"])
    return replace(one, pid=1, host="shared-host"), replace(two, pid=1, host="shared-host", jobs=(JOB,))


@pytest.fixture
def amqp_settings(rabbitmq_url):
    settings = Settings(broker_url=rabbitmq_url, broker_prefix=f"visbatch-test-{uuid.uuid4().hex[:8]}-")
    yield settings
    from kombu import Connection

    with Connection(rabbitmq_url) as conn:
        for name in (heartbeats.stream_name(settings), f"{settings.broker_prefix}ingest"):
            try:
                conn.channel().queue_delete(name)
            except Exception:  # noqa: S112 - never declared
                continue


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request) -> Settings:
    if request.param == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
        return Settings(broker_url=url, broker_prefix=prefix)
    return request.getfixturevalue("amqp_settings")


def test_two_workers_with_one_pid_and_host_are_two_and_a_warm_stop_takes_only_its_own(broker):
    one, two = _twins()
    assert heartbeats.live_workers(broker) == []
    heartbeats.beat(broker, one)
    heartbeats.beat(broker, two)
    live = heartbeats.live_workers(broker)
    assert sorted(c.instance for c in live) == sorted([one.instance, two.instance])
    assert {(c.host, c.pid) for c in live} == {("shared-host", 1)}
    by_instance = {c.instance: c for c in live}
    assert by_instance[one.instance].metrics_port == 9808 and by_instance[one.instance].queues == ("ingest",)
    assert by_instance[two.instance].jobs == (JOB,) and by_instance[two.instance].metrics_port is None

    heartbeats.withdraw(broker, one)  # the warm stop of one of them
    assert [c.instance for c in heartbeats.live_workers(broker)] == [two.instance]
    if heartbeats.is_redis(broker.broker_url):
        # What `submit`, `status` and the stall watch count (RabbitMQ counts its own consumers):
        # the other worker still consumes ingest.
        states = queue_states(broker, ["ingest", "encode"])
        assert states is not None and states["ingest"].consumers == 1 and states["encode"].consumers == 1


def test_a_newer_beat_replaces_the_older_and_a_silent_worker_is_gone(broker):
    one, _ = _twins()
    heartbeats.beat(broker, one)
    heartbeats.beat(broker, replace(one, jobs=(JOB,)))
    (live,) = heartbeats.live_workers(broker)
    assert live.jobs == (JOB,)

    # A worker killed outright says nothing: its last beat ages out (135 s), whatever it wrote.
    later = datetime.now(UTC) + timedelta(seconds=heartbeats.FRESH_S + 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(heartbeats, "_now", lambda: later)
        if heartbeats.is_redis(broker.broker_url):
            patch.setattr(heartbeats.time, "time", lambda: later.timestamp())
        assert heartbeats.live_workers(broker) == []


def test_the_stall_watch_beats_the_card_with_its_jobs_in_hand_and_withdraws_it(redis_url, redis_prefix):
    from celery.worker import state

    from worker.drivers.fleet.stall_watch import StallWatch, jobs_in_hand

    class Request:  # what Celery keeps of a running task: its arguments
        def __init__(self, *args):
            self.args = list(args)

    settings = Settings(broker_url=redis_url, broker_prefix=redis_prefix)
    running = [Request(JOB, [1, 2]), Request(JOB, [3]), Request("b" * 32, 4, "store:x", 0), Request()]
    for request in running:
        state.active_requests.add(request)
    try:
        assert jobs_in_hand() == (JOB, "b" * 32)
        watch = StallWatch(settings, card=_twins()[0])
        watch._beat()
        (live,) = heartbeats.live_workers(settings)
        assert live.jobs == (JOB, "b" * 32) and live.beat_at
    finally:
        for request in running:
            state.active_requests.discard(request)
    watch.close()
    assert heartbeats.live_workers(settings) == []


def test_workers_lists_them_in_80_columns_and_as_json(redis_url, redis_prefix, monkeypatch):
    monkeypatch.setenv("VISBATCH_BROKER_URL", redis_url)
    monkeypatch.setenv("VISBATCH_BROKER_PREFIX", redis_prefix)
    settings = Settings(broker_url=redis_url, broker_prefix=redis_prefix)
    one, two = _twins()
    runner = CliRunner()
    empty = runner.invoke(app, ["workers"])
    assert empty.exit_code == 0 and "no live worker" in empty.stderr, empty.output
    assert json.loads(runner.invoke(app, ["workers", "--json"]).stdout) == []

    heartbeats.beat(settings, one)
    heartbeats.beat(settings, two)
    shown = runner.invoke(app, ["workers", "--json"])
    assert shown.exit_code == 0, shown.output
    records = json.loads(shown.stdout)
    assert {r["instance"] for r in records} == {one.instance, two.instance}
    first = next(r for r in records if r["instance"] == two.instance)
    assert first["host"] == "shared-host" and first["pid"] == 1 and first["jobs"] == [JOB]
    assert first["queues"] == ["ingest", "encode"] and first["up_s"] >= 0 and first["started_at"]
    table = runner.invoke(app, ["workers"])
    assert table.exit_code == 0 and one.instance in table.stdout and two.instance in table.stdout
    assert ":9808" in table.stdout and JOB[:12] in table.stdout


def test_the_table_fits_80_columns_with_a_pod_name_and_many_jobs():
    card = WorkerCard(
        instance="418ecc37e4f4", host="visbatch-worker-gpu-7d9f8c6b5-x2kqz", queues=("ingest", "encode",
        "generate"), pid=123456, started_at="2026-12-01T10:00:00+00:00", metrics_port=9808,
        jobs=tuple(f"{i:x}" * 32 for i in range(5)), beat_at="2026-12-03T10:00:00+00:00",
    )  # fmt: skip
    records = worker_records([card], now=datetime(2026, 12, 3, 10, 0, 5, tzinfo=UTC))
    assert records[0]["up_s"] == 2 * 86400 + 5 and records[0]["last_beat_s"] == 5
    buffer = io.StringIO()
    Console(file=buffer, width=80, color_system=None).print(workers_table(records))
    lines = buffer.getvalue().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, buffer.getvalue()
    text = buffer.getvalue()
    assert "418ecc37e4f4" in text and "2d00h" in text and all(f"{i:x}" * 12 in text for i in range(5)), text
    assert [shown_duration(s) for s in (5, 125, 3 * 3600 + 300, 90000)] == ["5s", "2m", "3h05m", "1d01h"]


def test_workers_says_when_the_broker_cannot_be_reached(closed_port, monkeypatch):
    monkeypatch.setenv("VISBATCH_BROKER_URL", f"redis://127.0.0.1:{closed_port}/0")
    result = CliRunner().invoke(app, ["workers"])
    assert result.exit_code == EXIT_UNAVAILABLE, result.output
    assert f"cannot reach the broker redis://127.0.0.1:{closed_port}/0" in result.stderr, result.stderr
    assert "VISBATCH_BROKER_URL" in result.stderr
