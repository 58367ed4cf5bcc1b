"""Submitting jobs to the fleet and watching them: what `visbatch submit`, `cancel` and `--wait` do.

Nothing here loads a model or imports torch: a submit or a cancel answers in well under a second.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from ingest.spec import JobSpec
from ingest.stage import expand_paths, file_sha256
from storage import repository as repo
from storage.models import FINISHED_JOB_STATUSES
from visbatch.settings import Settings
from worker.runtime import Runtime
from worker.stages.start import SourceInput, SourceToIngest, start_job
from worker.stages.window_checks import refuse_misfit_window

_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def upload_key(path: Path, sha256: str) -> str:
    name = _UNSAFE_NAME.sub("_", path.name).strip("._")[:100] or "source"
    return f"sources/{sha256}/{name}"


def resolve_inputs(rt: Runtime, inputs: list[str]) -> list[SourceInput]:
    """Local files are uploaded to the object store (so any worker can read them);
    s3:// objects are read in place; an s3:// prefix ending in '/' is listed."""
    from storage.object_store import iter_s3_uris

    refs: list[SourceInput] = []
    for item in inputs:
        if item.startswith("s3://"):
            if item.endswith("/"):
                refs.extend(
                    SourceInput(u, u) for u in iter_s3_uris(item, endpoint_url=rt.settings.s3_endpoint_url)
                )
            else:
                refs.append(SourceInput(item, item))
            continue
        for path in expand_paths([Path(item)]):
            if not path.is_file():
                refs.append(SourceInput(str(path), None, "file not found"))
                continue
            sha, _ = file_sha256(path)
            key = upload_key(path, sha)
            if not rt.store.exists(key):
                rt.store.put_file(key, path)
            refs.append(SourceInput(str(path), f"store:{key}"))
    return refs


def enqueue_ingest(job_id: str, sources: list[SourceToIngest]) -> None:
    from worker.drivers.fleet.tasks import ingest_source

    for source in sources:
        ingest_source.apply_async((job_id, source.source_id, source.location))


def submit_job(rt: Runtime, inputs: list[str], spec: JobSpec) -> str:
    """Create the job and its sources (storage.jobs.start_job), then one ingest task per source.
    Where each source is read is recorded, so that the fleet can resume a stalled job itself."""
    local = expand_paths([Path(i) for i in inputs if not i.startswith("s3://")])
    refuse_misfit_window(spec, local, rt.model_name, rt.settings)
    job_id, sources = start_job(rt, spec, resolve_inputs(rt, inputs), fleet=True)
    try:
        enqueue_ingest(job_id, sources)
    except Exception as exc:  # broker down: say so on the job rather than leave it running
        repo.set_job_status(rt.db, job_id, "failed", error=f"could not enqueue: {type(exc).__name__}: {exc}")
        raise
    return job_id


# A job needs every stage; ingest first, so it is named first. The whole check is bounded well
# under a second: a submit is never slowed for a warning.
JOB_STAGES = ("ingest", "encode", "generate")
CONSUMER_CHECK_TIMEOUT_S = 0.5


def missing_workers_warning(settings: Settings) -> str | None:
    """A line to show when no worker consumes a queue a job needs (its job then waits), with the
    command that starts one; None when every queue has a worker or the broker cannot tell."""
    from worker.drivers.fleet.consumers import stages_without_consumer, start_hint

    missing = stages_without_consumer(settings, JOB_STAGES, timeout=CONSUMER_CHECK_TIMEOUT_S)
    if not missing:
        return None
    queues = ", ".join(missing)
    noun = "queue" if len(missing) == 1 else "queues"
    return f"warning: no worker consumes {noun} {queues}: the job waits until one does; {start_hint(missing)}"


def cancel_job(rt: Runtime, job_id: str) -> str:
    """Stop a job's remaining work: tasks check the job's state first and drop cancelled work; the
    generate loops abort its requests in flight within a second."""
    full_id = repo.resolve_job_id(rt.db, job_id)
    state = repo.job_state(rt.db, full_id)
    if state is not None and state[0] not in FINISHED_JOB_STATUSES:
        repo.set_job_status(rt.db, full_id, "cancelled", error="cancelled by the user; finished work is kept")
    return full_id


def wait_for_job(
    rt: Runtime,
    job_id: str,
    on_progress: Callable[[dict], None] | None = None,
    *,
    poll_seconds: float = 1.0,
    timeout: float | None = None,
) -> dict:
    """Poll the job until it reaches a final state; returns its summary."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        summary = repo.job_summary(rt.db, job_id, max_errors=50)
        if on_progress:
            on_progress(summary)
        if summary["status"] in FINISHED_JOB_STATUSES:
            return summary
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {summary['status']} after {timeout}s")
        time.sleep(poll_seconds)
