"""Starting a job (its sources, their holds) and reopening a stopped one: the same for both drivers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ingest.spec import JobSpec
from storage import repository as repo
from visbatch.settings import Settings
from worker.errors import UserError
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


def refuse_misfit_window(spec: JobSpec, paths: list[Path], model: str, settings: Settings) -> None:
    """A job whose windows cannot run is refused before it starts, naming the file (UserError:
    exit 2): static-patch dropping with pruning or merging, a time window (`--window
    10s`) over a PDF or an image, and a window whose tokens do not fit the model's context (the
    planner's count: worker.planning). An input read elsewhere
    (s3://, a drop folder) is refused by its own source instead, at ingest."""
    plan = spec.window_plan()
    if spec.budget.drop_static > 0 and (plan is None or plan.size == 1):
        raise UserError(
            f"--drop-static {spec.budget.drop_static:g}: it drops what did not change between the "
            "frames of a window, and this job has no window of several units",
            "add --window (e.g. --window 10s) or leave out --drop-static",
        )
    if plan is None:
        return
    if spec.budget.drop_static > 0 and (spec.budget.prune_keep < 1.0 or spec.budget.merge_keep < 1.0):
        raise UserError(
            f"--drop-static {spec.budget.drop_static:g} with --prune-keep or --merge-keep: each "
            "chooses a window's tokens its own way",
            "keep --drop-static for clips that change little, or --prune-keep/--merge-keep, not both",
        )
    from ingest.detect import still_kind  # PyAV with it: only for a job that has a window

    for path in paths:
        kind = still_kind(path) if plan.by_time else None
        if kind is not None:
            raise UserError(
                f"{path}: --window {spec.window} counts seconds of video, and this is {_A_KIND[kind]}",
                "give videos only, or a window of pages: --window N[:S]",
            )
    from ingest.limits import Limits
    from worker.planning.planner import WINDOW_FIXES, load_plan_model, plan_job, windows_over_context

    try:
        plan_model = load_plan_model(model, settings.model_revision)
    except (OSError, ValueError):  # the model cannot be read: loading it says so, with the fix
        return
    refused = windows_over_context(plan_job(paths, spec, plan_model, limits=Limits.from_settings(settings)))
    if refused:
        raise UserError("; ".join(refused), WINDOW_FIXES)


_A_KIND = {"pdf": "a PDF", "image": "an image"}


def reopen_job(rt: StartNeeds, job_id: str) -> tuple[repo.ReopenedJob, JobSpec]:
    """A stopped job made runnable again in place (storage.jobs.reopen_job), with its spec."""
    reopened = repo.reopen_job(rt.db, job_id)
    state = repo.job_state(rt.db, reopened.job_id)
    assert state is not None
    return reopened, JobSpec.model_validate(state[1])
