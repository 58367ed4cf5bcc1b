"""Starting a job (its sources, their holds) and reopening a stopped one: the same for both drivers."""

from __future__ import annotations

from dataclasses import dataclass

from ingest.spec import JobSpec
from storage import repository as repo
from worker.stages.needs import StartNeeds


@dataclass(frozen=True)
class SourceInput:
    """One input as the user named it (`uri`: shown in status and results), where a worker reads
    it (`location`: a local path, store:<key> or s3://...), or why it cannot be read (`error`)."""

    uri: str
    location: str | None
    error: str | None = None


@dataclass(frozen=True)
class SourceToIngest:
    source_id: int
    uri: str
    location: str


def start_job(
    rt: StartNeeds, spec: JobSpec, inputs: list[SourceInput], *, fleet: bool = False
) -> tuple[str, list[SourceToIngest]]:
    """Create the job (running, spec with the runtime's model) and its sources in one transaction.

    Returns the job id and the sources to ingest. An input given with an error is a failed
    source; a job with nothing to ingest is already closed when this returns. A `fleet` job
    records where each source is read, so that any worker can send its ingest again
    (worker.drivers.fleet.stall_watch).
    """
    job_spec = spec.model_copy(update={"model": rt.model_name})
    pairs = [(i.uri, i.error or (None if i.location else "file not found")) for i in inputs]
    location = {i.uri: i.location for i in inputs}
    recorded = {uri: where for uri, where in location.items() if where} if fleet else None
    started = repo.start_job(rt.db, job_spec, pairs, recorded)
    return started.job_id, [
        SourceToIngest(source_id, uri, location[uri] or uri) for source_id, uri in started.sources
    ]


def reopen_job(rt: StartNeeds, job_id: str) -> tuple[repo.ReopenedJob, JobSpec]:
    """A stopped job made runnable again in place (storage.jobs.reopen_job), with its spec."""
    reopened = repo.reopen_job(rt.db, job_id)
    state = repo.job_state(rt.db, reopened.job_id)
    assert state is not None
    return reopened, JobSpec.model_validate(state[1])
