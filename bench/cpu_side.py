"""Q13. The CPU side is light: how long `visbatch status` takes as a process, and how much memory
an ingest worker holds while it ingests.

  status      `visbatch status JOB` on a finished job (SQLite), a whole process, start-up included,
              beside `python -c pass` (the interpreter's own start) in the same run
  jobs        `visbatch jobs`, the same way
  ingest RSS  a real `visbatch worker --queues ingest` (prefork, 2 processes) on Redis and
              PostgreSQL ingests a 200-page PDF; its process tree's peak PSS (psutil, every 0.2 s:
              shared pages counted once)

Needs the PostgreSQL and Redis of the development machine for the ingest worker (skipped, and
said so, when they are not reachable).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Check, arguments, bars, median, rounded, run, write_result
from bench.media import report_pdf
from bench.models import bench_model

VISBATCH = str(Path(sys.executable).with_name("visbatch"))
POSTGRES = os.environ.get("VISBATCH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("VISBATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _seconds(argv: list[str], env: dict[str, str], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        run(argv, env=env)
        out.append(time.perf_counter() - started)
    return out


def _peak_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    import psutil

    root = psutil.Process(pid)
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
            # PSS: pages shared between the pool's processes (forked) counted once, as the machine does.
            peak[0] = max(peak[0], sum(p.memory_full_info().pss for p in procs))
        except psutil.Error:
            pass
        stop.wait(0.2)


def ingest_worker_rss(pages: int) -> dict | None:
    """Peak RSS of an ingest worker (parent + pool) ingesting one PDF; None without the services."""
    import uuid

    import redis
    from sqlalchemy import create_engine, text

    try:
        redis.Redis.from_url(REDIS, socket_connect_timeout=2).ping()
        engine = create_engine(POSTGRES)
        schema = f"bench_{uuid.uuid4().hex[:12]}"
        with engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as exc:
        print(f"[cpu_side] ingest worker skipped: {exc}", flush=True)
        return None
    pdf = report_pdf(pages, variant="rss")
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as tmp:
        url = f"{POSTGRES}?options=-csearch_path%3D{schema}"
        env = {
            **os.environ,
            "VISBATCH_HOME": tmp,
            "VISBATCH_DATABASE_URL": url,
            "VISBATCH_BROKER_URL": REDIS,
            "VISBATCH_BROKER_PREFIX": f"bench-{schema}:",
            "VISBATCH_MODEL": str(bench_model("tiny")),
        }
        argv = [VISBATCH, "worker", "--queues", "ingest", "--concurrency", "2", "--no-metrics"]
        worker = subprocess.Popen(
            argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        jobs_db = create_engine(url)
        stop, peak = threading.Event(), [0]
        sampler = threading.Thread(target=_peak_rss, args=(worker.pid, stop, peak), daemon=True)
        sampler.start()
        try:
            job = (
                run([VISBATCH, "submit", str(pdf), "-p", "hi"], env=env, text=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            query = text("SELECT count(*) FROM sources WHERE job_id = :id AND status <> 'pending'")
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                with jobs_db.connect() as conn:
                    if conn.execute(query, {"id": job}).scalar_one():
                        break
                time.sleep(0.5)
        finally:
            stop.set()
            os.killpg(worker.pid, 15)
            worker.wait(timeout=60)
            jobs_db.dispose()
            with engine.begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            engine.dispose()
            import redis as redis_lib

            client = redis_lib.Redis.from_url(REDIS)
            keys = list(client.scan_iter(match=f"bench-{schema}:*"))
            if keys:
                client.delete(*keys)
    return {"pages": pages, "peak_pss_mb": round(peak[0] / 2**20, 1)}


def main() -> None:
    args = arguments(__doc__, default_reps=7, quick_reps=3)
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        model = bench_model("tiny")
        env = {**os.environ, "VISBATCH_HOME": tmp, "VISBATCH_MODEL": str(model)}
        pdf = report_pdf(2, variant="cli")
        job = run([VISBATCH, "run", str(pdf), "-p", "hi", "--max-new-tokens", "2"], env=env, text=True)
        job_id = job.stdout.strip().splitlines()[0]
        status = _seconds([VISBATCH, "status", job_id], env, args.reps)
        jobs = _seconds([VISBATCH, "jobs"], env, args.reps)
        python = _seconds([sys.executable, "-c", "pass"], env, args.reps)
    rss = ingest_worker_rss(40 if args.quick else 200)
    figures = {
        "status_s": rounded(median(status)),
        "jobs_s": rounded(median(jobs)),
        "python_start_s": rounded(median(python)),
        "ingest_worker": rss,
    }
    checks = [
        Check("`visbatch status JOB`, whole process", figures["status_s"], "<=", 0.5, unit=" s"),
        Check(
            "ingest worker peak memory, PSS (parent + 2 pool processes + splitting children)",
            rss["peak_pss_mb"] if rss else None,
            "<=",
            300,
            unit=" MB",
        ),
    ]
    write_result(
        "cpu_side",
        quick=args.quick,
        question=__doc__.splitlines()[0],
        baseline="`python -c pass` in the same run (the interpreter's start)",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            ["python -c pass", "visbatch status", "visbatch jobs"],
            [figures["python_start_s"], figures["status_s"], figures["jobs_s"]],
            "seconds",
            "Q13 CPU side: commands as processes",
        ),
    )


if __name__ == "__main__":
    main()
