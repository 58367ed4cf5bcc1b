"""Submitting jobs to the fleet and watching them: what `visbatch submit`, `cancel` and `--wait` do."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ingest.spec import JobSpec
from ingest.stage import expand_paths, file_sha256
from storage import fleet
from storage import repository as repo
from storage.models import FINISHED_JOB_STATUSES
from storage.object_store import iter_s3_uris
from worker.runtime import Runtime

_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class SourceRef:
    uri: str  # what the user named: shown in status and results
    location: str | None  # where a worker reads it; None: it could not be found


def upload_key(path: Path, sha256: str) -> str:
    name = _UNSAFE_NAME.sub("_", path.name).strip("._")[:100] or "source"
    return f"sources/{sha256}/{name}"


def resolve_inputs(rt: Runtime, inputs: list[str]) -> list[SourceRef]:
    """Local files are uploaded to the object store (so any worker can read them);
    s3:// objects are read in place; an s3:// prefix ending in '/' is listed."""
    refs: list[SourceRef] = []
    for item in inputs:
        if item.startswith("s3://"):
            refs.extend(_s3_refs(rt, item))
            continue
        for path in expand_paths([Path(item)]):
            if not path.is_file():
                refs.append(SourceRef(str(path), None))
                continue
            sha, _ = file_sha256(path)
            key = upload_key(path, sha)
            if not rt.store.exists(key):
                rt.store.put_file(key, path)
            refs.append(SourceRef(str(path), f"store:{key}"))
    return refs


def _s3_refs(rt: Runtime, uri: str) -> list[SourceRef]:
    if not uri.endswith("/"):
        return [SourceRef(uri, uri)]
    return [SourceRef(u, u) for u in iter_s3_uris(uri, endpoint_url=rt.settings.s3_endpoint_url)]


def submit_job(rt: Runtime, inputs: list[str], spec: JobSpec) -> str:
    """Create the job, its sources and their holds, then enqueue one ingest task per source."""
    from worker.tasks import ingest_source

    job_spec = spec.model_copy(update={"model": rt.model_name})
    job_id = repo.create_job(rt.db, job_spec.model_dump(mode="json"), status="queued")
    refs = resolve_inputs(rt, inputs)
    sources = [(repo.add_source(rt.db, job_id, ref.uri), ref) for ref in refs]
    live = [(sid, ref) for sid, ref in sources if ref.location is not None]
    for sid, ref in sources:
        if ref.location is None:
            repo.fail_source(rt.db, sid, "file not found")
    fleet.hold_for_sources(rt.db, job_id, len(live))
    repo.set_job_status(rt.db, job_id, "running")
    try:
        for sid, ref in live:
            ingest_source.apply_async((job_id, sid, ref.location))
    except Exception as exc:  # broker down: say so on the job rather than leave it running
        repo.set_job_status(rt.db, job_id, "failed", error=f"could not enqueue: {type(exc).__name__}: {exc}")
        raise
    if not live:
        repo.close_job(rt.db, job_id)
    return job_id


def cancel_job(rt: Runtime, job_id: str) -> str:
    """Stop a job's remaining work: tasks check the job's state first and drop cancelled work."""
    full_id = repo.resolve_job_id(rt.db, job_id)
    state = fleet.job_state(rt.db, full_id)
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
