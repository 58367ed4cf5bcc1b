"""Issue 32: a SIGKILLed GPU worker's job, done how long after the kill? Redis and RabbitMQ side by side.

The fleet as deployed on this machine, with the shipped settings (visibility timeout 100 s,
restore sweep every 5 s): an ingest worker and two GPU workers (encode + generate), real
`visbatch worker` processes, jobs submitted with `visbatch submit` as a user does. Once the
job's first answers are stored, one GPU worker (the one that answered first... whichever holds
messages: both prefetch) is SIGKILLed; the figure is the seconds from the kill to the job's final
row, every page answered exactly once. On Redis a dead worker's messages used to wait out the
visibility timeout (~100 s, 292 s once on a loaded machine); its alive key now lapses in 15 s and
a live worker's sweep hands them back (worker/drivers/fleet/broker_redis.py). RabbitMQ hands them back
when the dead worker's connection drops. Target: both within 45 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import Check, arguments, bars, rounded, write_result
from bench.fleet_proc import VISBATCH, BenchFleet
from bench.media import report_pdf
from bench.models import bench_model
from bench.results_db import scratch_schema

BROKERS = {
    "redis": os.environ.get("VISBATCH_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
    "rabbitmq": os.environ.get("VISBATCH_BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"),
}
TARGET_S = 45.0


def _answers(db, job: str) -> int:
    from sqlalchemy import func, select

    from storage.models import RESULTS

    with db.session(readonly=True) as session:
        return int(session.scalar(select(func.count()).where(RESULTS.c.job_id == job)) or 0)


def one_kill(broker: str, model: Path, pages: int, work: Path) -> dict:
    from storage.db import Database

    with scratch_schema() as url:
        fleet = BenchFleet(work / broker, model, url)
        fleet.env["VISBATCH_BROKER_URL"] = BROKERS[broker]
        # Small encode messages, so that both GPU workers hold some when one is killed.
        fleet.env["VISBATCH_ENCODE_CHUNK_UNITS"] = "2"
        (work / broker).mkdir(parents=True, exist_ok=True)
        db = Database(url)
        try:
            fleet.start_worker("ingest")
            victim = fleet.start_worker("encode,generate")
            fleet.start_worker("encode,generate")
            pdfs = [str(report_pdf(pages, variant=f"dead-{broker}-{d}")) for d in range(2)]
            submitted = subprocess.run(
                [VISBATCH, "submit", *pdfs, "-p", "What is on this page?", "--max-new-tokens", "4"],
                env={**os.environ, **fleet.env}, capture_output=True, text=True, check=True, timeout=300,
            )  # fmt: skip
            job = submitted.stdout.strip()
            deadline = time.monotonic() + 600
            while _answers(db, job) == 0:  # the workers are warm and holding messages
                if time.monotonic() > deadline:
                    raise TimeoutError(fleet.logs())
                time.sleep(0.1)
            os.killpg(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            victim.wait()
            fleet.workers.remove(victim)  # dead on purpose: wait() must not fail on it
            status = fleet.wait(db, job, timeout=600)
            after = time.monotonic() - killed
            # Redis: how many of the dead worker's messages a live worker handed back (its log).
            logs = "\n".join(p.read_text() for p in sorted((work / broker).glob("worker-*.log")))
            restored = sum(
                int(line.split("broker: ", 1)[1].split(" ", 1)[0])
                for line in logs.splitlines()
                if "handed back to their queues" in line
            )
            return {
                "seconds_after_kill": rounded(after),
                "status": status,
                "answers": _answers(db, job),
                "pages": 2 * pages,
                "messages_handed_back": restored if broker == "redis" else None,
            }
        finally:
            fleet.close()
            db.dispose()


def main() -> None:
    args = arguments(__doc__, default_reps=1, quick_reps=1)
    model = bench_model("vision")
    pages = 8 if args.quick else 24
    with tempfile.TemporaryDirectory(prefix="bench-dead-worker-") as tmp:
        runs = {broker: one_kill(broker, model, pages, Path(tmp)) for broker in BROKERS}
    checks = [
        Check(
            f"{broker}: job done after a GPU worker's SIGKILL", run["seconds_after_kill"], "<=", TARGET_S, "s"
        )
        for broker, run in runs.items()
    ]
    checks += [
        Check(f"{broker}: every page answered once", float(run["answers"] == run["pages"]), ">=", 1.0, "")
        for broker, run in runs.items()
    ]
    write_result(
        "dead_worker",
        quick=args.quick,
        question="A SIGKILLed GPU worker's job: seconds from the kill to done",
        baseline="the target (45 s); before, Redis waited out the 100 s visibility timeout",
        reps=1,
        checks=checks,
        figures={"runs": runs, "model": model.name},
        chart=bars(list(runs), [r["seconds_after_kill"] for r in runs.values()], "s", "kill -> job done"),
    )


if __name__ == "__main__":
    main()
