"""Real Celery worker processes for end-to-end tests: `visbatch worker` started as subprocesses.

Each test gets its own broker key prefix on the shared Redis and its own PostgreSQL schema,
so tests never see each other's tasks or rows. Time limits are short so that a task whose
worker was killed is handed to another worker within seconds, not the production hour.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url

from storage.db import Database
from worker.drivers.fleet.supervisor import die_with_parent

REDIS_URL = os.environ.get("VISBATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
VISBATCH = str(Path(sys.executable).with_name("visbatch"))


# PostgreSQL trusts local connections and ignores this password: it is there to prove that
# workers never print it (see test_fleet_e2e).
DB_PASSWORD = "fleet-pw-do-not-log"


class Fleet:
    def __init__(
        self,
        tmp: Path,
        model_dir: Path,
        database_url: str,
        worker_database_url: str | None = None,
        broker_url: str = REDIS_URL,
        *,
        shipped: bool = False,
    ) -> None:
        """`worker_database_url`: where workers and the CLI connect (e.g. through a fault proxy);
        the test itself always watches through `database_url`. `shipped=True` keeps the shipped
        time limit, visibility timeout and restore interval (tests about the fleet as deployed)."""
        self.tmp = tmp
        worker_url = make_url(worker_database_url or database_url).set(password=DB_PASSWORD)
        self.prefix = f"visbatch-test-{uuid.uuid4().hex[:8]}:"
        self.env = {
            **os.environ,
            "VISBATCH_HOME": str(tmp / "home"),
            "VISBATCH_MODEL": str(model_dir),
            "VISBATCH_DATABASE_URL": worker_url.render_as_string(hide_password=False),
            "VISBATCH_BROKER_URL": broker_url,
            "VISBATCH_BROKER_PREFIX": self.prefix,
        }
        shortened = ("TASK_TIME_LIMIT", "60"), ("VISIBILITY_TIMEOUT", "75"), ("UNACKED_RESTORE_INTERVAL", "1")
        for name, value in shortened:
            if shipped:
                self.env.pop(f"VISBATCH_{name}", None)  # nor a developer's own value
            else:
                self.env[f"VISBATCH_{name}"] = value
        self.broker_url = broker_url
        self.db = Database(database_url)
        self.workers: list[subprocess.Popen] = []
        self.stopped: list[subprocess.Popen] = []  # stopped on purpose (stop_worker)

    def set(self, **values: str) -> None:
        self.env.update({f"VISBATCH_{k.upper()}": v for k, v in values.items()})

    def start_worker(
        self, queues: str, *extra: str, wrap: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """`visbatch worker --queues QUEUES EXTRA...`, under `wrap` when given (a command that runs
        its arguments, e.g. `unshare ...`: a worker in its own namespaces, as in a container), with
        `env` over the fleet's (another host's addresses of the same services)."""
        log = open(self.tmp / f"worker-{len(self.workers)}-{queues.replace(',', '-')}.log", "w")  # noqa: SIM115
        options = extra or ("--no-metrics",)
        proc = subprocess.Popen(
            [*wrap, VISBATCH, "worker", "--queues", queues, "--loglevel", "INFO", *options],
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # A test run killed (a timeout, Ctrl-C twice) takes its workers with it.
            preexec_fn=die_with_parent,  # noqa: PLW1509
        )
        self.workers.append(proc)
        return proc

    def stop_worker(self, proc: subprocess.Popen, timeout: float = 60) -> int:
        """SIGTERM (a warm shutdown, as systemd stops it) and wait; SIGKILL after `timeout`."""
        self.stopped.append(proc)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill(proc)
        return proc.returncode

    def run_cli(self, *args: str) -> str:
        """Run `visbatch ARGS` in a separate process, as a user would; returns stdout + stderr."""
        done = subprocess.run(
            [VISBATCH, *args], env=self.env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr

    def submit(self, *args: str) -> str:
        """`visbatch submit ARGS`; returns the job id (stdout's last line)."""
        done = subprocess.run(
            [VISBATCH, "submit", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    def status(self, job_id: str) -> str:
        with self.db.engine.connect() as conn:
            return conn.execute(text("SELECT status FROM jobs WHERE id = :id"), {"id": job_id}).scalar_one()

    def wait(self, job_ids: list[str], timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        finished = {"succeeded", "partial", "failed", "cancelled"}
        while time.monotonic() < deadline:
            if all(self.status(j) in finished for j in job_ids):
                return
            for proc in self.workers:
                if proc not in self.stopped:
                    assert proc.poll() in (None, -signal.SIGKILL), f"worker exited with {proc.returncode}"
            time.sleep(0.5)
        raise AssertionError(f"jobs not finished after {timeout}s: {[self.status(j) for j in job_ids]}")

    def results_per_unit(self, job_id: str) -> dict[int, list[int]]:
        """unit id -> sorted prompt indexes of its results (duplicates would show twice)."""
        sql = text(
            "SELECT u.id, r.prompt_index FROM units u LEFT JOIN results r ON r.unit_id = u.id "
            "WHERE u.job_id = :id ORDER BY u.id, r.prompt_index"
        )
        out: dict[int, list[int]] = {}
        with self.db.engine.connect() as conn:
            for unit_id, prompt_index in conn.execute(sql, {"id": job_id}):
                out.setdefault(unit_id, [])
                if prompt_index is not None:
                    out[unit_id].append(prompt_index)
        return out

    def result_count(self, job_id: str) -> int:
        with self.db.engine.connect() as conn:
            sql = text("SELECT count(*) FROM results WHERE job_id = :id")
            return conn.execute(sql, {"id": job_id}).scalar_one()

    def kill(self, proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def kill_all(self) -> None:
        """SIGKILL every worker still running: a teardown that need not wait out a warm shutdown
        (up to 15 s a worker in close()), whose close() then only cleans up (issue 20)."""
        for proc in self.workers:
            if proc.poll() is None:
                self.kill(proc)

    def close(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.broker_url.startswith("amqp"):
            self._delete_amqp_queues()
        else:
            client = redis.Redis.from_url(self.broker_url)
            keys = list(client.scan_iter(match=f"{self.prefix}*"))
            if keys:
                client.delete(*keys)
        self.db.dispose()

    def _delete_amqp_queues(self) -> None:
        """This fleet's queues (their names carry its prefix) leave RabbitMQ with it."""
        from kombu import Connection

        with Connection(self.broker_url) as conn:
            channel = conn.channel()
            # The stage queues, and the stream of the workers' heartbeats (worker.drivers.fleet.heartbeats).
            for stage in ("ingest", "encode", "generate", "visbatch.workers"):
                try:
                    channel.queue_delete(f"{self.prefix}{stage}")
                except Exception:  # noqa: S112 - a queue never declared: nothing to delete
                    channel = conn.channel()

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(p.read_text()[-tail:] for p in sorted(self.tmp.glob("worker-*.log")))
