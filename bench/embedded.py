"""The embedded pipeline driven stage by stage, so each stage can be timed on its own.

`run_staged` makes the same calls as `worker.pipeline.run_job`, in the same order, with a clock
around each stage; `answers` reads a job's results back for comparing two runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ingest.spec import JobSpec
from storage import repository as repo
from storage.settings import Settings
from worker.pipeline import NullProgress, encode_job, generate_job, ingest_job
from worker.runtime import Runtime

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
    """Run a job like run_job; returns (job id, {stage: seconds})."""
    progress = NullProgress()
    job_spec = spec.model_copy(update={"model": rt.model_name})
    job_id = repo.create_job(rt.db, job_spec.model_dump(mode="json"), status="running")
    seconds: dict[str, float] = {}
    steps = {
        "ingest": lambda: ingest_job(rt, job_id, paths, spec, progress),
        "encode": lambda: encode_job(rt, job_id, progress),
        "generate": lambda: generate_job(rt, job_id, spec, progress),
    }
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
