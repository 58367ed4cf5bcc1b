"""The control plane's ceiling: "GPU" workers on the load engine, raised until a service saturates.

Each step starts N `visbatch worker --queues encode,generate` processes whose engine is the load
engine (worker/engines/load_engine.py, capacity tests only: no model compute, fixed answers after
the time an emulated GPU takes: VISBATCH_LOAD_TOKENS_PER_S tokens/s, each request costing
VISBATCH_LOAD_REQUEST_TOKENS, a 7B model's 1288-px page), one ingest worker, against ONE
PostgreSQL (the machine's, a scratch schema), ONE broker (a dedicated redis-server, then the
machine's RabbitMQ) and ONE cache Redis (dedicated). Images go to a local folder (S3 scales
out by itself). Each step submits a job sized for ~STEP_SECONDS of work at the step's ideal rate
(N x the emulated GPU's pages/s) and records, once a second:

- pages done (jobs.units_total - units_pending) -> pages/s in the job's steady middle part;
- the broker's queue depths (Redis LLEN; RabbitMQ passive queue.declare): growth = a backlog;
- the round trip of the bench's own progress query (a one-row SELECT by primary key): SQL latency;
- CPU seconds of every service process: the Redis servers, the PostgreSQL backends of this run
  (found by application_name), RabbitMQ's beam.smp (shared with the machine), the workers, and
  the machine's busy share (/proc/stat).

Saturation: a step whose pages/s is below 80% of its ideal (N x one emulated GPU), or a service
near a full core. The report names what saturated first and, since this machine has only 2 cores
shared by everything (services, workers, other users), the CPU seconds each service spent per
1,000 pages, from which a reader can extrapolate to a machine with more cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import Check, lines, results_dir, rounded, write_result
from bench.service_counters import RedisProcess, cpu_seconds, tree_cpu_seconds, usage_totals

VISBATCH = str(Path(sys.executable).with_name("visbatch"))
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
REQUEST_TOKENS = 1650  # ~1,518 visual tokens (7B, 1288-px page) + a prompt + new tokens
TOKENS_PER_S = 20_000.0  # one emulated GPU (the planner's stated assumption, docs/budget.md)
STEP_SECONDS = 40.0
DOCS = 4  # PDFs per job: the ingest worker's two processes split them
MAX_PAGES = 4000


def speed() -> float:
    """How many times faster than one GPU each load worker runs in this step (CP_SPEED): the
    cheap way past the worker processes this small machine can hold."""
    return float(os.environ.get("CP_SPEED", "1"))


def gpu_pages_per_s() -> float:
    return TOKENS_PER_S / REQUEST_TOKENS


def make_pdf(path: Path, pages: int) -> Path:
    """A PDF of `pages` identical small pages: after the first, every page is a store and token
    cache hit, so the renderer and the tower do little and the services carry the load."""
    import pymupdf

    doc = pymupdf.open()
    for _ in range(pages):
        page = doc.new_page(width=200, height=280)
        page.insert_text((20, 40), "Invoice 1042  total 17.50", fontsize=9)
    doc.save(path)
    doc.close()
    return path


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def beam_pid() -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"beam.smp" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    return None


class Step:
    """One step: N load workers, one job, sampled once a second."""

    def __init__(self, broker: str, workers: int, env: dict[str, str], work: Path, services: dict[str, Any]):
        self.broker, self.n, self.env, self.work, self.services = broker, workers, env, work, services
        self.procs: list[subprocess.Popen] = []

    def start(self, queues: str, extra: list[str]) -> None:
        name = f"{self.broker}-{self.n}-{len(self.procs)}-{queues.replace(',', '-')}.log"
        log = open(self.work / name, "w")  # noqa: SIM115 - the worker writes it until it stops
        self.procs.append(
            subprocess.Popen(
                [VISBATCH, "worker", "--queues", queues, "--loglevel", "WARNING", "--no-metrics", *extra],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        )

    def stop(self) -> None:
        import signal

        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_step(step: Step, client: Any, engine: Any, spec: Any, pdf_dir: Path) -> dict[str, Any]:
    from sqlalchemy import text

    from worker.drivers.fleet.submit import submit_job

    ideal = step.n * gpu_pages_per_s() * speed()
    # At most MAX_PAGES: at the fastest steps the job is shorter, not the ingest queue longer.
    pages = int(min(MAX_PAGES, max(120, ideal * STEP_SECONDS)) // DOCS) * DOCS
    paths = [make_pdf(pdf_dir / f"{step.broker}-{step.n}-{d}-{uuid.uuid4().hex[:6]}.pdf", pages // DOCS)
             for d in range(DOCS)]  # fmt: skip
    step.start("ingest", ["--concurrency", "2"])
    for _ in range(step.n):
        step.start("encode,generate", [])
    _wait_ready(step, client, spec, engine, pdf_dir)
    usage_before = usage_totals(Path(step.env["VISBATCH_USAGE_DIR"]))
    cpu_before = _cpu(step)
    busy0 = machine_busy()
    job = submit_job(client, [str(p) for p in paths], spec)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    while True:
        t0 = time.perf_counter()
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT status, units_total, units_pending FROM jobs WHERE id = :id"), {"id": job}
            ).one()
        latency_ms = (time.perf_counter() - t0) * 1000
        _pg_backends(step)  # backends may come and go: their CPU is read while they live
        samples.append({
            "t": round(time.monotonic() - started, 2), "done": max(0, row.units_total - row.units_pending),
            "total": row.units_total, "sql_ms": round(latency_ms, 2), "queues": _depths(step),
        })  # fmt: skip
        if row.status in ("succeeded", "partial", "failed", "cancelled"):
            break
        if time.monotonic() - started > 20 * STEP_SECONDS:
            raise TimeoutError(f"step {step.broker} x{step.n} did not finish")
        if any(p.poll() is not None for p in step.procs):
            raise RuntimeError(f"a worker exited in step {step.broker} x{step.n}")
        time.sleep(1.0)
    wall = time.monotonic() - started
    busy1 = machine_busy()
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in _cpu(step).items()}
    time.sleep(1.0)
    usage = {
        k: v - usage_before.get(k, 0) for k, v in usage_totals(Path(step.env["VISBATCH_USAGE_DIR"])).items()
    }
    step.stop()
    if row.status != "succeeded":
        raise RuntimeError(f"job ended {row.status}")
    rate = _steady_rate(samples)
    total = pages
    machine = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    depth_growth = _depth_growth(samples)
    latencies = sorted(s["sql_ms"] for s in samples)
    return {
        "broker": step.broker,
        "workers": step.n,
        "speed": speed(),
        "emulated_gpus": step.n * speed(),
        "ideal_pages_per_s": rounded(ideal),
        "pages": total,
        "wall_s": round(wall, 1),
        "pages_per_s": rounded(rate),
        "efficiency": rounded(rate / ideal),
        "machine_busy_share": rounded(machine),
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "cpu_share_of_a_core": {k: rounded(v / wall) for k, v in cpu.items()},
        "cpu_s_per_1000_pages": {k: rounded(v * 1000 / total) for k, v in cpu.items()},
        "sql_probe_ms": {"p50": latencies[len(latencies) // 2], "p90": latencies[int(len(latencies) * 0.9)]},
        "queue_depth_max": depth_growth["max"],
        "queue_depth_growth_per_s": depth_growth["growth"],
        "usage": usage,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "samples": samples,
    }


def _wait_ready(step: Step, client: Any, spec: Any, engine: Any, pdf_dir: Path) -> None:
    """A one-page job through the fresh workers: every worker has loaded its tower when a job
    per worker has gone through (the broker spreads them), so the step times a warm fleet."""
    from sqlalchemy import text

    from worker.drivers.fleet.submit import submit_job

    jobs = [submit_job(client, [str(make_pdf(pdf_dir / f"warm-{uuid.uuid4().hex[:6]}.pdf", 2))], spec)
            for _ in range(step.n)]  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            states = [
                conn.execute(text("SELECT status FROM jobs WHERE id = :id"), {"id": j}).scalar() for j in jobs
            ]
        if all(s in ("succeeded", "partial", "failed") for s in states):
            time.sleep(1.0)
            return
        time.sleep(0.5)
    raise TimeoutError("the workers did not warm up")


def _cpu(step: Step) -> dict[str, float]:

    out: dict[str, float] = {}
    for name, service in step.services.items():
        if isinstance(service, RedisProcess):
            out[name] = service.cpu_seconds()
    out["workers, load engine"] = sum(tree_cpu_seconds(p.pid) for p in step.procs[1:])
    out["worker, ingest"] = tree_cpu_seconds(step.procs[0].pid)
    out["postgresql backends"] = _pg_backends(step)
    if step.broker == "rabbitmq" and step.services.get("beam"):
        out["rabbitmq (shared beam.smp)"] = cpu_seconds(step.services["beam"])
    out["bench process"] = cpu_seconds(os.getpid())
    return out


def _pg_backends(step: Step) -> float:
    """CPU seconds of this run's PostgreSQL backends (application_name), each read while it lives."""
    from sqlalchemy import text

    with step.services["admin"].connect() as conn:
        sql = text("SELECT pid FROM pg_stat_activity WHERE application_name = :a")
        pids = conn.execute(sql, {"a": step.env["APP_NAME"]}).scalars().all()
    seen = step.services.setdefault("pg_backends", {})
    for pid in pids:
        seen[pid] = max(seen.get(pid, 0.0), cpu_seconds(pid))
    return sum(seen.values())


def _depths(step: Step) -> dict[str, int]:
    prefix = step.env["VISBATCH_BROKER_PREFIX"]
    depths: dict[str, int] = {}
    if step.broker == "redis":
        import redis

        client = redis.Redis.from_url(step.env["VISBATCH_BROKER_URL"])
        try:
            for q in ("ingest", "encode", "generate"):
                depths[q] = int(client.llen(f"{prefix}{q}"))
        finally:
            client.close()
        return depths
    from kombu import Connection

    with Connection(RABBITMQ_URL) as conn:
        channel = conn.channel()
        for q in ("ingest", "encode", "generate"):
            try:
                depths[q] = int(channel.queue_declare(f"{prefix}{q}", passive=True).message_count)
            except Exception:  # noqa: BLE001 - not declared yet
                channel = conn.channel()
                depths[q] = 0
    return depths


def _steady_rate(samples: list[dict[str, Any]]) -> float:
    """Pages/s between 20% and 90% of the job's pages done (ramp-up and tail left out)."""
    total = samples[-1]["total"] or 1
    first = next((s for s in samples if s["done"] >= 0.2 * total), samples[0])
    last = next((s for s in samples if s["done"] >= 0.9 * total), samples[-1])
    if last["t"] <= first["t"]:
        return samples[-1]["done"] / max(samples[-1]["t"], 1e-3)
    return (last["done"] - first["done"]) / (last["t"] - first["t"])


def _depth_growth(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"max": {}, "growth": {}}
    for q in ("ingest", "encode", "generate"):
        depth = [s["queues"].get(q, 0) for s in samples]
        out["max"][q] = max(depth) if depth else 0
        peak = depth.index(max(depth)) if depth else 0
        out["growth"][q] = rounded(depth[peak] / max(samples[peak]["t"], 1.0)) if depth else 0.0
    return out


def run_broker(
    broker: str, counts: list[tuple[int, float]], work: Path, database_url: str, model: Path
) -> list[dict[str, Any]]:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    app = f"visbatch-cp-{uuid.uuid4().hex[:6]}"
    url = make_url(database_url)
    options = url.query.get("options", "")
    url = url.update_query_dict({"application_name": app, "options": options}).render_as_string(
        hide_password=False
    )
    cache = RedisProcess(work / f"{broker}-cache", role="cache")
    services: dict[str, Any] = {"redis, cache": cache, "admin": create_engine(make_url(database_url))}
    env = {
        **os.environ,
        "APP_NAME": app,
        "VISBATCH_HOME": str(work / "home"),
        "VISBATCH_MODEL": str(model),
        "VISBATCH_DEVICE": "cpu",
        "VISBATCH_ENGINE": "load",
        "VISBATCH_LOAD_TOKENS_PER_S": str(TOKENS_PER_S),
        "VISBATCH_LOAD_REQUEST_TOKENS": str(REQUEST_TOKENS),
        "VISBATCH_DATABASE_URL": url,
        "VISBATCH_STORE_URL": f"file://{work / 'store'}",
        "VISBATCH_CACHE_URL": cache.url,
        "VISBATCH_BROKER_PREFIX": f"cp-{uuid.uuid4().hex[:8]}:",
        "VISBATCH_USAGE_DIR": str(work / f"usage-{broker}"),
        "TRANSFORMERS_VERBOSITY": "error",
    }
    if broker == "redis":
        broker_redis = RedisProcess(work / "broker", role="broker")
        services["redis, broker"] = broker_redis
        env["VISBATCH_BROKER_URL"] = broker_redis.url
    else:
        services["beam"] = beam_pid()
        env["VISBATCH_BROKER_URL"] = RABBITMQ_URL
    steps: list[dict[str, Any]] = []
    # This process submits: its Celery app must be built for this broker (a child process).
    code = (
        "import json,sys; from bench.control_plane import _child; "
        "print('RESULT'+json.dumps(_child(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])))"
    )
    try:
        for n, fast in counts:
            print(f"== {broker}: {n} load worker(s), each {fast:g} GPU(s)", flush=True)
            done = subprocess.run(
                [sys.executable, "-c", code, broker, str(n), str(work)],
                env={**env, "CP_SERVICES": _service_pids(services), "CP_SPEED": str(fast)},
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            lines_ = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
            if done.returncode != 0 or not lines_:
                print(done.stdout[-2000:], done.stderr[-4000:])
                raise RuntimeError(f"step {broker} x{n} failed")
            step = json.loads(lines_[-1][len("RESULT") :])
            steps.append(step)
            print(f"   {step['pages_per_s']} pages/s (ideal {step['ideal_pages_per_s']}), machine "
                  f"{step['machine_busy_share']:.0%} busy, cores {step['cpu_share_of_a_core']}",
                  flush=True)  # fmt: skip
            if step["efficiency"] < 0.5:
                break  # well past saturation: more workers only add waiting
    finally:
        for s in services.values():
            if isinstance(s, RedisProcess):
                s.close()
        services["admin"].dispose()
        if broker == "rabbitmq":
            _delete_queues(env["VISBATCH_BROKER_PREFIX"])
    return steps


def _service_pids(services: dict[str, Any]) -> str:
    return json.dumps({
        k: (v.port if isinstance(v, RedisProcess) else v) for k, v in services.items() if k != "admin"
    })  # fmt: skip


class _RedisRef(RedisProcess):
    """A RedisProcess started by the parent: this process reads its pid and port only."""

    def __init__(self, port: int) -> None:  # noqa: D107 - no server started here
        self.port = port
        import redis

        client = redis.Redis(port=port)
        self._pid = int(client.info("server")["process_id"])
        client.close()

    def cpu_seconds(self) -> float:
        return cpu_seconds(self._pid)

    def close(self) -> None:
        pass


def _child(broker: str, n: int, work: str) -> dict[str, Any]:
    import json
    import logging

    from sqlalchemy import create_engine

    from ingest.spec import IngestOptions, JobSpec, Sampling
    from visbatch.settings import Settings
    from worker.runtime import Runtime

    logging.disable(logging.WARNING)
    refs = json.loads(os.environ["CP_SERVICES"])
    services: dict[str, Any] = {}
    for name, value in refs.items():
        services[name] = _RedisRef(value) if name.startswith("redis") else value
    url = os.environ["VISBATCH_DATABASE_URL"]
    services["admin"] = create_engine(url.split("?")[0])
    engine = create_engine(url)  # the bench's own probe: not counted (not storage.db.Database)
    env = dict(os.environ)
    env["VISBATCH_LOAD_TOKENS_PER_S"] = str(TOKENS_PER_S * speed())
    step = Step(broker, n, env, Path(work), services)
    spec = JobSpec(prompts=["What is the total?"], sampling=Sampling(max_new_tokens=8),
                   ingest=IngestOptions(longest_side=280))  # fmt: skip
    client = Runtime(Settings())
    pdf_dir = Path(work) / "pdfs"
    pdf_dir.mkdir(exist_ok=True)
    try:
        return run_step(step, client, engine, spec, pdf_dir)
    finally:
        step.stop()
        client.close()
        engine.dispose()


def _delete_queues(prefix: str) -> None:
    from kombu import Connection

    with Connection(RABBITMQ_URL) as conn:
        for q in ("ingest", "encode", "generate"):
            try:
                conn.channel().queue_delete(f"{prefix}{q}")
            except Exception:  # noqa: BLE001, S112
                continue


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 and 2 workers only, Redis broker only")
    parser.add_argument(
        "--steps", default="1,4,8,8x3",
        help="steps: N load workers, or NxS: N workers each emulating S GPUs (a faster one)",
    )  # fmt: skip
    parser.add_argument("--brokers", default="redis,rabbitmq")
    args = parser.parse_args()
    raw = "1,2" if args.quick else args.steps
    counts = [(int(n), float(f or 1)) for n, _, f in (x.partition("x") for x in raw.split(","))]
    brokers = ["redis"] if args.quick else [b.strip() for b in args.brokers.split(",")]
    from bench.models import bench_model
    from bench.results_db import scratch_schema

    model = bench_model("tiny")
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-control-plane-") as tmp, scratch_schema() as url:
        for broker in brokers:
            results[broker] = run_broker(broker, counts, Path(tmp), url, model)
    summary = {b: _verdict(steps) for b, steps in results.items()}
    for b, v in summary.items():
        print(f"[control_plane] {b}: {v}")
    # The harness itself must drive one emulated GPU at its rate, or no step measures the services.
    checks = [
        Check(f"{b}: 1 worker's pages/s / one emulated GPU's", steps[0]["efficiency"], ">=", 0.8,
              note=summary[b]["first_saturated"])
        for b, steps in results.items() if steps[0]["workers"] == 1
    ]  # fmt: skip
    write_result(
        "control_plane",
        quick=args.quick,
        question="The control plane's ceiling: pages/s at saturation, and which service saturated first",
        baseline="the ideal: N workers x one emulated GPU's pages/s",
        reps=1,
        checks=checks,
        figures={"steps": {b: [{k: v for k, v in s.items() if k != "samples"} for s in steps]
                           for b, steps in results.items()},
                 "summary": summary, "request_tokens": REQUEST_TOKENS, "gpu_tokens_per_s": TOKENS_PER_S},
        chart=lines(
            [{"label": b, "x": [s["emulated_gpus"] for s in steps], "y": [s["pages_per_s"] for s in steps]}
             for b, steps in results.items()],
            "emulated GPUs (load workers x speed)", "pages/s", "Control plane: pages/s vs workers",
        ),
        notes=["2 cores shared by every service, worker and other user of this machine: "
               "see cpu_s_per_1000_pages"],
    )  # fmt: skip
    samples = {b: [s["samples"] for s in steps] for b, steps in results.items()}
    (results_dir(args.quick) / "control_plane_samples.json").write_text(json.dumps(samples))


def _verdict(steps: list[dict[str, Any]]) -> dict[str, Any]:
    best = max(steps, key=lambda s: s["pages_per_s"])
    saturated = next((s for s in steps if s["efficiency"] < 0.8), None)
    at = saturated or steps[-1]
    services = {k: v for k, v in at["cpu_share_of_a_core"].items() if k not in ("bench process",)}
    top = max(services, key=services.get)
    busy = at["machine_busy_share"]
    if saturated is None:
        efficiency = at["efficiency"]
        gpus = at["emulated_gpus"]
        first = f"nothing yet at {gpus:g} emulated GPUs (efficiency {efficiency:.2f}, {busy:.0%} busy)"
    elif busy >= 0.9:
        first = f"the machine's 2 cores ({busy:.0%} busy); busiest: {top} ({services[top]:.2f} core)"
    else:
        first = f"{top} ({services[top]:.2f} of a core)"
    growing = {q: g for q, g in at["queue_depth_growth_per_s"].items() if g > 1}
    return {
        "best_pages_per_s": best["pages_per_s"],
        "best_at_workers": best["workers"],
        "saturated_at_workers": saturated["workers"] if saturated else None,
        "first_saturated": first,
        "queues_growing": growing,
        "sql_probe_ms_at_saturation": at["sql_probe_ms"],
        "cpu_s_per_1000_pages": at["cpu_s_per_1000_pages"],
    }


if __name__ == "__main__":
    main()
