"""Per-unit cost, counted on a real run: what one page and one answer ask of the services.

The same bench job (report PDFs, two prompts, the tiny random Qwen2-VL of bench/models.py, the
transformers engine on the CPU) runs in four arms, each in a process of its own (a Celery app
reads its broker once, at import):

  embedded-sqlite    `run_job` in one process with the embedded defaults (SQLite, folders)
  embedded-services  `run_job` against PostgreSQL, a Redis hot cache, S3 (store + cold cache)
  fleet-redis        an ingest worker + an encode,generate worker (`visbatch worker`), Redis broker
  fleet-rabbitmq     the same on RabbitMQ

Every service is the arm's own, and counts on its side of the wire where it can:
- broker, Redis: a dedicated redis-server, INFO commandstats (LPUSH = a message published,
  BRPOP = a fetch; ZADD/HSET = kombu's unacked bookkeeping) and its network bytes;
- broker, RabbitMQ: a relay in front of the machine's RabbitMQ that parses the AMQP frames and
  counts basic.publish (client to server), basic.deliver (server to client), basic.ack both ways
  (a consumer's ack; a publisher confirm) and bytes (bench/service_counters.py);
- cache: a dedicated redis-server, INFO commandstats and network bytes;
- S3: moto's S3 API behind a counting WSGI layer: requests by method, body bytes in and out;
- SQL: statements, transactions and rows written, counted in every process by storage.usage
  (SQLAlchemy engine events; on only because VISBATCH_USAGE_DIR is set), summed over processes;
  Celery's before_task_publish / task_prerun in every process as a cross-check of the broker's.

Counts are the difference between just before the measured job is submitted and just after it
ended; a warm-up job before it loads the models. Background traffic (idle broker polls, the stall
watch) is measured over an idle window before the job and reported as a rate, not subtracted.
`--arm NAME` runs one arm and prints its JSON (what the parent does for each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import ROOT, Check, bars, rounded, write_result

ARMS = ("embedded-sqlite", "embedded-services", "fleet-redis", "fleet-rabbitmq")
PROMPTS = ["What is on this page?", "What is the total?"]
IDLE_WINDOW_S = 10.0


def job_inputs(quick: bool) -> list[Path]:
    from bench.media import report_pdf

    docs, pages = (1, 10) if quick else (2, 20)
    return [report_pdf(pages, variant=f"unit-costs-{d}") for d in range(docs)]


def spec():
    from ingest.spec import IngestOptions, JobSpec, Sampling

    return JobSpec(
        prompts=PROMPTS, sampling=Sampling(max_new_tokens=8), ingest=IngestOptions(longest_side=644)
    )


# --- one arm, in its own process --------------------------------------------------------------


def run_arm(arm: str, quick: bool, out: Path) -> None:
    from bench.models import bench_model
    from bench.service_counters import AmqpCounter, CountingS3, RedisProcess

    work = Path(tempfile.mkdtemp(prefix="bench-unit-costs-"))
    usage_dir = work / "usage"
    os.environ["VISBATCH_USAGE_DIR"] = str(usage_dir)  # before storage.usage is imported
    model = bench_model("tiny")
    services: list[Any] = []
    counters: dict[str, Any] = {}
    env = {
        "VISBATCH_HOME": str(work / "home"),
        "VISBATCH_MODEL": str(model),
        "VISBATCH_DEVICE": "cpu",
        "VISBATCH_ENGINE": "transformers",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    with _schema(arm) as database_url:
        try:
            if arm != "embedded-sqlite":
                s3 = CountingS3()
                bucket = f"unit-costs-{uuid.uuid4().hex[:8]}"
                s3.make_bucket(bucket)
                cache = RedisProcess(work / "cache", role="cache")
                services += [s3, cache]
                counters.update(s3=s3, cache=cache)
                env.update(
                    VISBATCH_DATABASE_URL=database_url,
                    VISBATCH_STORE_URL=f"s3://{bucket}/store",
                    VISBATCH_CACHE_URL=cache.url,
                    VISBATCH_CACHE_COLD_URL=f"s3://{bucket}/token-cache",
                    VISBATCH_S3_ENDPOINT_URL=s3.endpoint,
                )
            if arm == "fleet-redis":
                broker = RedisProcess(work / "broker", role="broker")
                services.append(broker)
                counters["broker"] = broker
                env["VISBATCH_BROKER_URL"] = broker.url
                env["VISBATCH_BROKER_PREFIX"] = f"unit-costs-{uuid.uuid4().hex[:8]}:"
            elif arm == "fleet-rabbitmq":
                relay = AmqpCounter()
                services.append(relay)
                counters["broker"] = relay
                env["VISBATCH_BROKER_URL"] = relay.url()
                env["VISBATCH_BROKER_PREFIX"] = f"unit-costs-{uuid.uuid4().hex[:8]}:"
            os.environ.update(env)
            figures = (
                _fleet(arm, quick, work, counters)
                if arm.startswith("fleet")
                else _embedded(arm, quick, counters)
            )
        finally:
            for service in services:
                service.close()
    out.write_text(json.dumps(figures))
    shutil.rmtree(work, ignore_errors=True)  # kept only when the arm failed (its worker logs)


class _Snapshot:
    def __init__(self, counters: dict[str, Any]) -> None:
        from bench.service_counters import usage_totals
        from storage import usage

        self.counters = counters
        self.usage_dir = usage.DIRECTORY
        usage.write()  # this process's counts on disk too
        self.values = {name: c.counts() for name, c in counters.items()}
        self.values["usage"] = usage_totals(usage.DIRECTORY) if usage.DIRECTORY else {}
        self.at = time.monotonic()

    def minus(self, before: _Snapshot) -> dict[str, dict[str, int]]:
        from bench.service_counters import delta

        return {name: delta(self.values[name], before.values.get(name, {})) for name in self.values}


def _embedded(arm: str, quick: bool, counters: dict[str, Any]) -> dict[str, Any]:
    from bench.embedded import quiet
    from storage import repository as repo
    from visbatch.settings import Settings
    from worker.drivers.embedded import run_job
    from worker.runtime import Runtime

    quiet()
    rt = Runtime(Settings())
    from bench.media import report_pdf

    run_job(rt, [report_pdf(2, variant="unit-costs-warmup")], spec())
    before = _Snapshot(counters)
    started = time.monotonic()
    job = run_job(rt, job_inputs(quick), spec())
    seconds = time.monotonic() - started
    after = _Snapshot(counters)
    summary = repo.job_summary(rt.db, job)
    rt.close()
    return _figures(arm, summary, after.minus(before), seconds, idle={}, idle_s=0.0)


def _fleet(arm: str, quick: bool, work: Path, counters: dict[str, Any]) -> dict[str, Any]:
    from sqlalchemy import create_engine, text

    from bench.fleet_proc import BenchFleet
    from bench.media import report_pdf
    from storage import repository as repo
    from visbatch.settings import Settings
    from worker.drivers.fleet.submit import submit_job
    from worker.runtime import Runtime

    fleet = BenchFleet(work, Path(os.environ["VISBATCH_MODEL"]), os.environ["VISBATCH_DATABASE_URL"])
    fleet.env.update({k: v for k, v in os.environ.items() if k.startswith("VISBATCH_")})
    # The bench's own polling is not the product's cost: a plain engine, not storage.db.Database.
    watcher = create_engine(os.environ["VISBATCH_DATABASE_URL"])

    def wait(job: str) -> str:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with watcher.connect() as conn:
                status = conn.execute(text("SELECT status FROM jobs WHERE id = :id"), {"id": job}).scalar()
            if status in ("succeeded", "partial", "failed", "cancelled"):
                return status
            if any(p.poll() is not None for p in fleet.workers):
                raise RuntimeError(f"a worker exited:\n{fleet.logs()}")
            time.sleep(0.05)
        raise TimeoutError(f"job {job} not finished:\n{fleet.logs()}")

    try:
        fleet.start_worker("ingest")
        fleet.start_worker("encode,generate")
        client = Runtime(Settings())
        wait(submit_job(client, [str(report_pdf(2, variant="unit-costs-warmup"))], spec()))
        time.sleep(2)  # the warm-up's last writes and acks land
        idle_before = _Snapshot(counters)
        time.sleep(IDLE_WINDOW_S)
        before = _Snapshot(counters)
        idle = before.minus(idle_before)
        started = time.monotonic()
        job = submit_job(client, [str(p) for p in job_inputs(quick)], spec())
        wait(job)
        seconds = time.monotonic() - started
        time.sleep(1.5)  # acks, and the usage files' next write (every 0.5 s)
        after = _Snapshot(counters)
        summary = repo.job_summary(client.db, job)
        client.close()
    finally:
        fleet.close()
        watcher.dispose()
        if arm == "fleet-rabbitmq":
            _delete_queues(os.environ["VISBATCH_BROKER_PREFIX"])
    return _figures(arm, summary, after.minus(before), seconds, idle=idle, idle_s=IDLE_WINDOW_S)


def _delete_queues(prefix: str) -> None:
    from kombu import Connection

    with Connection("amqp://guest:guest@127.0.0.1:5672//") as conn:
        for stage in ("ingest", "encode", "generate"):
            try:
                conn.channel().queue_delete(f"{prefix}{stage}")
            except Exception:  # noqa: BLE001, S112 - never declared
                continue


def _figures(
    arm: str, summary: dict[str, Any], counted: dict[str, dict[str, int]], seconds: float,
    *, idle: dict[str, dict[str, int]], idle_s: float,
) -> dict[str, Any]:  # fmt: skip
    if summary["status"] != "succeeded":
        raise RuntimeError(f"{arm}: the job ended {summary['status']}: {summary.get('errors')}")
    pages = int(summary["units_total"])
    answers = int(summary["results"]) + int(summary["results_failed"])
    return {
        "arm": arm,
        "pages": pages,
        "answers": answers,
        "seconds": round(seconds, 2),
        "counts": counted,
        "idle_per_minute": {k: {n: round(v * 60 / idle_s, 1) for n, v in d.items()} for k, d in idle.items()}
        if idle_s
        else {},
    }


class _schema:
    """A scratch PostgreSQL schema for the arms that use PostgreSQL; None for the SQLite arm."""

    def __init__(self, arm: str) -> None:
        self.arm = arm
        self._cm: Any = None

    def __enter__(self) -> str | None:
        if self.arm == "embedded-sqlite":
            return None
        from bench.results_db import scratch_schema

        self._cm = scratch_schema()
        return self._cm.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)


# --- the report -------------------------------------------------------------------------------

# (label, service, counter): the rows printed per page and per answer.
ROWS = [
    ("broker messages published", "usage", "celery.published"),
    ("broker messages consumed", "usage", "celery.consumed"),
    ("Redis broker LPUSH (publish)", "broker", "redis.lpush"),
    ("Redis broker BRPOP (fetch)", "broker", "redis.brpop"),
    ("Redis broker commands", "broker", "redis.commands"),
    ("Redis broker bytes in+out", "broker", "redis.bytes"),
    ("AMQP basic.publish", "broker", "amqp.basic.publish_up"),
    ("AMQP basic.deliver", "broker", "amqp.basic.deliver_down"),
    ("AMQP basic.ack (consumer)", "broker", "amqp.basic.ack_up"),
    ("AMQP frames both ways", "broker", "amqp.frames"),
    ("AMQP bytes both ways", "broker", "amqp.bytes"),
    ("SQL statements", "usage", "sql.statements"),
    ("SQL transactions (commits)", "usage", "sql.commits"),
    ("SQL rows written", "usage", "sql.rows_written"),
    ("SQL connections opened", "usage", "sql.connections"),
    ("SQL pool checkouts (pre-pings)", "usage", "sql.checkouts"),
    ("cache Redis commands", "cache", "redis.commands"),
    ("cache Redis bytes in+out", "cache", "redis.bytes"),
    ("S3 requests", "s3", "s3.requests"),
    ("S3 bytes in+out", "s3", "s3.bytes"),
]


def _value(counts: dict[str, dict[str, int]], service: str, key: str) -> int | None:
    found = counts.get(service)
    if not found:
        return None
    if key in ("redis.bytes", "s3.bytes"):
        prefix = key.split(".")[0]
        return found.get(f"{prefix}.bytes_in", 0) + found.get(f"{prefix}.bytes_out", 0)
    if key in ("amqp.frames", "amqp.bytes"):
        return found.get(f"{key}_up", 0) + found.get(f"{key}_down", 0)
    return found.get(key, 0)


def table(arms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for label, service, key in ROWS:
        row: dict[str, Any] = {"what": label}
        for arm in arms:
            value = _value(arm["counts"], service, key)
            if value is None or (
                value == 0 and service == "broker" and key.split(".")[0] not in _broker_kind(arm)
            ):
                continue
            row[arm["arm"]] = {
                "total": value,
                "per_page": rounded(value / arm["pages"], 3),
                "per_answer": rounded(value / arm["answers"], 3),
            }
        if len(row) > 1:
            rows.append(row)
    return rows


def _broker_kind(arm: dict[str, Any]) -> str:
    return "redis" if arm["arm"] == "fleet-redis" else "amqp" if arm["arm"] == "fleet-rabbitmq" else ""


def print_table(arms: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    names = [a["arm"] for a in arms]
    print("per page / per answer (total) " + " | ".join(f"{n}: {a['pages']} pages, {a['answers']} answers"
                                                      for n, a in zip(names, arms, strict=True)))  # fmt: skip
    for row in rows:
        cells = []
        for n in names:
            c = row.get(n)
            cells.append("-" if c is None else f"{c['per_page']:g} / {c['per_answer']:g} ({c['total']})")
        print(f"  {row['what']:<30} " + " | ".join(f"{c:>24}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one 10-page PDF instead of two of 20 pages")
    parser.add_argument("--arm", choices=ARMS, help="run one arm and write its JSON to --out")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", default="", help="comma-separated arms (default: all)")
    args = parser.parse_args()
    if args.arm:
        run_arm(args.arm, args.quick, args.out)
        return
    chosen = [a.strip() for a in args.only.split(",") if a.strip()] or list(ARMS)
    load = Path("/proc/loadavg").read_text().split()[:3]
    arms: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-unit-costs-") as tmp:
        for arm in chosen:
            out = Path(tmp) / f"{len(arms)}.json"
            print(f"== {arm}", flush=True)
            cmd = [sys.executable, "-m", "bench.unit_costs", "--arm", arm, "--out", str(out)]
            subprocess.run(cmd + (["--quick"] if args.quick else []), cwd=ROOT, check=True)
            arms.append(json.loads(out.read_text()))
    rows = table(arms)
    print_table(arms, rows)
    per_page = {a["arm"]: _value(a["counts"], "usage", "sql.statements") / a["pages"] for a in arms}
    # A regression guard at the level issue 24's fix reached: a fleet page cost 4.7-4.8
    # transactions before it (a generate message read its job and its answers on its own), ~3 after.
    checks = [
        Check(f"SQL transactions per page, {a['arm']}", rounded(_value(a["counts"], "usage", "sql.commits")
              / a["pages"]), "<=", 3.5, unit="", note="4.7-4.8 before the fix")
        for a in arms if a["arm"].startswith("fleet")
    ]  # fmt: skip
    write_result(
        "unit_costs",
        quick=args.quick,
        question="Per-unit cost: what one page and one answer ask of PostgreSQL, the broker, Redis and S3",
        baseline="counts, not times: no baseline",
        reps=1,
        checks=checks,
        figures={"arms": arms, "table": rows, "loadavg_at_start": load},
        chart=bars(
            list(per_page),
            [rounded(v) for v in per_page.values()],
            "SQL statements / page",
            "Per-unit cost: SQL statements per page",
        ),  # fmt: skip
        notes=[
            "broker publish/consume also counted by Celery signals in every process (usage rows)",
            "Redis broker counts are the server's INFO commandstats; RabbitMQ's a frame-parsing relay",
            f"idle traffic (per minute, all processes) measured over {IDLE_WINDOW_S:.0f} s before the job",
        ],
    )


if __name__ == "__main__":
    main()
