"""Q7. Memory on a long document: peak RSS over a 2,000-page PDF against a 200-page one.

Two places where a long document could pile up memory, each measured over all its processes
(psutil samples every 50 ms; getrusage's ru_maxrss cross-checks the main process's peak):
  * the embedded ingest stage (`worker.drivers.embedded.ingest_only`: the splitting child process renders,
    hashes, PNG-encodes and stores; the main process writes unit rows in chunks to SQLite), run
    in a fresh process per document;
  * a fleet ingest worker (`visbatch worker --queues ingest`, prefork pool), started fresh per
    document, the job submitted to it, until the source is ingested (no encode worker runs).
Quick mode compares 200 pages against 20, embedded only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench.common import Check, arguments, bars, median, rounded, write_result
from bench.media import report_pdf
from bench.models import bench_model

MB = 2**20


class PeakSampler:
    """Largest RSS seen over a process tree: all processes together, the root, its children."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.root = psutil.Process(pid)
        self.every = every
        self.peak_process = 0  # the largest single process
        self.peak_root = 0
        self.peak_children = 0  # the largest single child (e.g. the process that splits sources)
        self.peak_tree = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _children(self) -> list[psutil.Process]:
        try:
            return self.root.children(recursive=True)
        except psutil.Error:
            return []

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = []
            for proc in [self.root, *self._children()]:
                try:
                    rss.append(proc.memory_info().rss)
                except psutil.Error:
                    rss.append(0)  # exited between the listing and the reading
            if rss:
                self.peak_root = max(self.peak_root, rss[0])
                self.peak_children = max(self.peak_children, max(rss[1:], default=0))
                self.peak_process = max(self.peak_process, max(rss))
                self.peak_tree = max(self.peak_tree, sum(rss))
            self._stop.wait(self.every)


def embedded_child(pdf: Path, home: Path, model: Path) -> dict:
    """In a fresh process: ingest one PDF embedded; peak RSS figures."""
    import resource

    from bench.embedded import quiet
    from ingest.spec import JobSpec
    from storage import repository as repo
    from visbatch.settings import Settings
    from worker.drivers.embedded import ingest_only
    from worker.runtime import Runtime

    quiet()
    rt = Runtime(Settings(home=home, database_url=f"sqlite:///{home}/visbatch.db"), model=str(model))
    rt.token_rule.count_visual_tokens(448, 448)  # the token rule loaded: what every run has
    spec = JobSpec(prompts=["p"])
    _ = rt.db
    before = psutil.Process().memory_info().rss
    with PeakSampler(os.getpid()) as sampler:
        started = time.perf_counter()
        job = ingest_only(rt, [pdf], spec)
        seconds = time.perf_counter() - started
    units = repo.job_summary(rt.db, job)["units_total"]
    rt.close()
    # RUSAGE_CHILDREN is no use for the splitting child: its ru_maxrss counts this process's pages
    # it shared between fork and exec. Its peak is psutil's.
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "rss_before": before,
        "peak_tree": sampler.peak_tree,
        "peak_root": max(own, sampler.peak_root),
        "peak_child": sampler.peak_children,
        "seconds": seconds,
        "units": units,
    }


def in_child(kind: str, pdf: Path, model: Path) -> dict:
    """Run one measurement in a fresh interpreter (its own memory; its own Celery app settings)."""
    with tempfile.TemporaryDirectory(prefix="bench-mem-") as tmp:
        cmd = [sys.executable, "-m", "bench.memory", "--child", kind, str(pdf), tmp, str(model)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker_child(pdf: Path, work: Path, model: Path) -> dict:
    """In a fresh process: a fresh ingest worker ingests one PDF; peak RSS of its processes."""
    from bench.fleet_proc import BenchFleet
    from bench.results_db import scratch_schema

    with scratch_schema() as url:
        fleet = BenchFleet(work, model, url)
        os.environ.update(fleet.env)
        from sqlalchemy import text

        from visbatch.settings import Settings
        from worker.drivers.fleet.submit import submit_job
        from worker.runtime import Runtime

        try:
            proc = fleet.start_worker("ingest")
            client = Runtime(Settings())
            with PeakSampler(proc.pid) as sampler:
                started = time.perf_counter()
                job = submit_job(client, [str(pdf)], _spec())
                sql = text("SELECT status FROM sources WHERE job_id = :id")
                while True:
                    with client.db.engine.connect() as conn:
                        status = conn.execute(sql, {"id": job}).scalar_one()
                    if status != "pending":
                        break
                    if proc.poll() is not None:
                        raise RuntimeError(fleet.logs())
                    time.sleep(0.2)
                seconds = time.perf_counter() - started
            with client.db.engine.connect() as conn:
                units = conn.execute(
                    text("SELECT count(*) FROM units WHERE job_id = :id"), {"id": job}
                ).scalar_one()
            client.close()
        finally:
            fleet.close()
    if status != "ingested":
        raise RuntimeError(f"worker ingest ended {status} with {units} units")
    return {
        "peak_process": sampler.peak_process,
        "peak_tree": sampler.peak_tree,
        "peak_root": sampler.peak_root,
        "peak_child": sampler.peak_children,
        "seconds": seconds,
        "units": units,
    }


def _spec():
    from ingest.spec import JobSpec

    return JobSpec(prompts=["p"])


PLACES = {
    "embedded": "embedded ingest stage (main + splitting process)",
    "worker": "ingest worker (all processes)",
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run = embedded_child if sys.argv[2] == "embedded" else worker_child
        print(json.dumps(run(Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))))
        return
    args = arguments(__doc__, default_reps=2, quick_reps=1)
    small, large = (20, 200) if args.quick else (200, 2000)
    places = ["embedded"] if args.quick else ["embedded", "worker"]
    model = bench_model("tiny")
    docs = {small: report_pdf(small), large: report_pdf(large)}
    runs: dict[str, dict[int, list[dict]]] = {place: {small: [], large: []} for place in places}
    for _rep in range(args.reps):
        for pages in (small, large):
            for place in places:
                run = in_child(place, docs[pages], model)
                if run["units"] != pages:
                    raise RuntimeError(f"{place}: the {pages}-page PDF gave {run['units']} units")
                runs[place][pages].append(run)

    def peak_mb(place: str, pages: int, key: str) -> float:
        return round(median([r[key] for r in runs[place][pages]]) / MB, 1)

    figures: dict = {"pages": [small, large]}
    checks, labels, values = [], [], []
    for place in places:
        keys = ["peak_tree", "peak_root", "peak_child"] + (["rss_before"] if place == "embedded" else [])
        figures[place] = {f"{key}_mb": {p: peak_mb(place, p, key) for p in (small, large)} for key in keys}
        figures[place]["seconds"] = {
            p: [round(r["seconds"], 1) for r in runs[place][p]] for p in (small, large)
        }
        tree = figures[place]["peak_tree_mb"]
        ratio = rounded(tree[large] / tree[small])
        checks.append(Check(f"{PLACES[place]}: peak RSS at {large} pages / at {small}", ratio, "<=", 1.10))
        labels += [f"{place} {small} p.", f"{place} {large} p."]
        values += [tree[small], tree[large]]
    notes = [] if "worker" in places else ["quick mode: the ingest worker is measured in full mode only"]
    write_result(
        "memory",
        quick=args.quick,
        question="Memory on a long document",
        baseline=f"the same stage over a {small}-page PDF",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(labels, values, "peak RSS, all processes (MiB)", "Q7 memory, long PDF"),
        notes=notes,
    )


if __name__ == "__main__":
    main()
