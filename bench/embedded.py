"""The embedded pipeline driven stage by stage, so each stage can be timed on its own.

`run_staged` runs the stages of `worker.stages` one after another, each to its end, with a clock
around each stage (the embedded run before it streamed); `answers` reads a job's results back
for comparing two runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ingest.spec import JobSpec
from storage import repository as repo
from storage.models import UnitStatus
from visbatch.settings import Settings
from worker.drivers.embedded import start_local_job
from worker.runtime import Runtime
from worker.stages.encode import encode_units
from worker.stages.generate import GenerateLoop, JobUnits
from worker.stages.ingest import ingest_source

STAGES = ("ingest", "encode", "generate")


def quiet() -> None:
    """No progress bars from transformers (weights loading) in the benchmark logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def runtime(home: Path, model: Path, **settings: Any) -> Runtime:
    """An embedded runtime (SQLite + folders under `home`) on the CPU, model weights loaded now."""
    quiet()
    rt = Runtime(Settings(home=home, device="cpu", engine="transformers", **settings), model=str(model))
    _ = rt.adapter.model, rt.engine, rt.db  # load outside any timed region
    return rt


def run_staged(rt: Runtime, paths: list[Path], spec: JobSpec, stages: tuple[str, ...] = STAGES):
    """Run a job one stage after another, each to its end before the next starts (the embedded
    run before streaming), with the same stage code; returns (job id, {stage: seconds})."""
    job_id, sources = start_local_job(rt, paths, spec)
    seconds: dict[str, float] = {}

    def ingest() -> None:
        for s in sources:
            ingest_source(rt, job_id, s.source_id, s.uri, Path(s.location), spec)

    def encode() -> None:
        units = repo.units_in_state(rt.db, job_id, UnitStatus.PENDING)
        step = rt.settings.encode_batch_images
        for start in range(0, len(units), step):
            encode_units(rt, units[start : start + step], spec)

    def generate() -> None:
        loop = GenerateLoop(rt)
        loop.add(JobUnits(repo.units_in_state(rt.db, job_id, UnitStatus.ENCODED), spec))
        loop.run_until_idle()

    steps = {"ingest": ingest, "encode": encode, "generate": generate}
    for stage in stages:
        started = time.perf_counter()
        steps[stage]()
        seconds[stage] = time.perf_counter() - started
    repo.close_job(rt.db, job_id)
    return job_id, seconds


def answers(rt: Runtime, job_id: str) -> dict[tuple, tuple]:
    """(source, unit, prompt) -> (text, output, error) of every result of the job."""
    return {
        (r["source"], r["unit"], r["prompt_index"]): (r["text"], r["output"], r["error"])
        for r in repo.iter_results(rt.db, job_id)
    }
