"""Two real workers as two containers run them (issue 32): each `visbatch worker` is pid 1 of its
own PID namespace, under one host name in its own UTS namespace (`unshare`, as root), on one
broker. Both are listed by `visbatch workers --json`, each its own instance, and the warm stop
(SIGTERM) of one leaves the other's entry, on Redis and on RabbitMQ.

Ingest workers alone (no model loaded, ~2 CPU-seconds each to start): about 5 s per broker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from tests.fleet_harness import REDIS_URL, VISBATCH, Fleet
from visbatch.settings import Settings
from worker.drivers.fleet.consumers import queue_states

pytestmark = [
    pytest.mark.fleet,
    pytest.mark.signals,
    pytest.mark.budget(60, reason="four real workers in their own namespaces, two per broker (8-10 s here)"),
]

HOST = "shared-host"
# Each worker in a container of its own: new PID and UTS (host name) namespaces, /proc of its own;
# the worker is exec'd as the namespace's pid 1 under the shared host name, and dies with the test.
CONTAINER = ["unshare", "--pid", "--fork", "--kill-child", "--uts", "--mount-proc",
             "sh", "-c", 'hostname "$0" && exec "$@"', HOST]  # fmt: skip


def _containers_refused() -> str | None:
    """Why this machine cannot make those namespaces (None when it can)."""
    if shutil.which("unshare") is None:
        return "no unshare here (util-linux)"
    try:
        done = subprocess.run([*CONTAINER[:-4], "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if done.returncode != 0:
        return f"unshare --pid --uts is not permitted here (root in CI): {done.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def containers() -> None:
    reason = _containers_refused()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def _workers(fleet: Fleet) -> list[dict]:
    command = [VISBATCH, "workers", "--json"]
    done = subprocess.run(command, env=fleet.env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _wait_for_workers(fleet: Fleet, count: int, timeout: float = 90) -> list[dict]:
    """`visbatch workers --json` once it lists `count` workers (each beats at once when ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _workers(fleet)
        if len(found) == count:
            return found
        time.sleep(0.5)
    raise AssertionError(f"not {count} live workers after {timeout} s: {found}\n{fleet.logs()}")


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_two_containers_with_pid_1_under_one_host_name_are_two_workers(
    broker, containers, tmp_path, postgres_url, request
):
    url = REDIS_URL if broker == "redis" else request.getfixturevalue("rabbitmq_url")
    # Ingest workers never load a model: none is built.
    fleet = Fleet(tmp_path, tmp_path / "no-model", postgres_url, broker_url=url)
    try:
        one = fleet.start_worker("ingest", "--concurrency", "1", "--no-supervise", "--metrics-port", "0",
                                 wrap=CONTAINER)  # fmt: skip
        fleet.start_worker("ingest", "--concurrency", "1", "--no-supervise", "--no-metrics", wrap=CONTAINER)
        both = _wait_for_workers(fleet, 2)
        assert {(w["host"], w["pid"]) for w in both} == {(HOST, 1)}, both  # what told them apart before
        assert len({w["instance"] for w in both}) == 2 and len({w["name"] for w in both}) == 2, both
        for worker in both:
            assert worker["name"] == f"visbatch-ingest-{worker['instance']}@{HOST}", worker
            assert worker["queues"] == ["ingest"] and worker["jobs"] == [] and worker["started_at"], worker
        served = next(w for w in both if w["metrics_port"] is not None)
        other = next(w for w in both if w["metrics_port"] is None)
        assert served["metrics_port"] > 0, both

        assert fleet.stop_worker(one) == 0, fleet.logs()  # a warm stop of the one serving metrics
        left = _workers(fleet)
        assert [w["instance"] for w in left] == [other["instance"]], (left, fleet.logs())
        # What `submit`, `status` and the stall watch count: ingest still has its worker.
        states = queue_states(Settings(broker_url=url, broker_prefix=fleet.prefix), ["ingest"], timeout=5)
        assert states is not None and states["ingest"].consumers == 1, states
    finally:
        fleet.kill_all()
        fleet.close()
