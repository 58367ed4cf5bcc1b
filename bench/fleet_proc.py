"""Real `visbatch worker` processes for the fleet benchmarks (as tests/fleet_harness.py starts them).

Each fleet gets its own broker key prefix on the local Redis and its own PostgreSQL schema
(bench.results_db.scratch_schema), so it never sees anybody else's tasks or rows. `env` is also
what this process must run under to submit jobs to that fleet: apply it before importing
worker.drivers.fleet.celery_app (the Celery app reads the settings once, at import).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REDIS_URL = os.environ.get("VISBATCH_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
VISBATCH = str(Path(sys.executable).with_name("visbatch"))
FINISHED = {"succeeded", "partial", "failed", "cancelled"}


class BenchFleet:
    def __init__(self, work: Path, model: Path, database_url: str) -> None:
        self.work = work
        self.prefix = f"visbatch-bench-{uuid.uuid4().hex[:8]}:"
        self.env = {
            "VISBATCH_HOME": str(work / "fleet-home"),
            "VISBATCH_MODEL": str(model),
            "VISBATCH_DATABASE_URL": database_url,
            "VISBATCH_BROKER_URL": REDIS_URL,
            "VISBATCH_BROKER_PREFIX": self.prefix,
            "VISBATCH_DEVICE": "cpu",
            "VISBATCH_ENGINE": "transformers",
            "TRANSFORMERS_VERBOSITY": "error",
        }
        self.workers: list[subprocess.Popen] = []

    def start_worker(self, queues: str) -> subprocess.Popen:
        log = open(self.work / f"worker-{len(self.workers)}-{queues.replace(',', '-')}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [VISBATCH, "worker", "--queues", queues, "--loglevel", "WARNING"],
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers.append(proc)
        return proc

    def wait(self, db, job_id: str, timeout: float = 900, poll: float = 0.05) -> str:
        """Poll the job row until it is final; fails if a worker died."""
        from storage import repository as repo

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = repo.job_state(db, job_id)
            if state is not None and state[0] in FINISHED:
                return state[0]
            for proc in self.workers:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {proc.returncode}:\n{self.logs()}")
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not finished after {timeout}s:\n{self.logs()}")

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        for proc in self.workers:
            self.stop(proc)
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{self.prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted(self.work.glob("worker-*.log")))
