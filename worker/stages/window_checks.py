"""A job whose windows cannot run is refused before anything runs, naming the file and the option
(UserError: exit 2), by `run`, `submit` and the API (``refuse_misfit_window``) and by `plan`
(``refuse_window_misuse``, which then counts the windows itself). An input read elsewhere
(s3://, a drop folder) is refused by its own source instead, at ingest."""

from __future__ import annotations

from pathlib import Path

from ingest.spec import JobSpec
from visbatch.settings import Settings
from worker.errors import UserError

_A_KIND = {"pdf": "a PDF", "image": "an image"}


def refuse_window_misuse(spec: JobSpec, paths: list[Path]) -> None:
    """Options that cannot go together, whatever the model: static-patch dropping without windows
    or with pruning or merging, and a time window (`--window 10s`) over a PDF or an image."""
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
    if not plan.by_time:
        return
    from ingest.detect import still_kind  # PyAV with it: only for a job with a time window

    for path in paths:
        kind = still_kind(path)
        if kind is not None:
            raise UserError(
                f"{path}: --window {spec.window} counts seconds of video, and this is {_A_KIND[kind]}",
                "give videos only, or a window of pages: --window N[:S]",
            )


def refuse_misfit_window(spec: JobSpec, paths: list[Path], model: str, settings: Settings) -> None:
    """``refuse_window_misuse``, then a window whose tokens do not fit the model's context (the
    planner's count: worker.planning)."""
    refuse_window_misuse(spec, paths)
    if spec.window_plan() is None:
        return
    from ingest.limits import Limits
    from worker.planning.planner import WINDOW_FIXES, load_plan_model, plan_job, windows_over_context

    try:
        plan_model = load_plan_model(model, settings.model_revision)
    except (OSError, ValueError):  # the model cannot be read: loading it says so, with the fix
        return
    refused = windows_over_context(plan_job(paths, spec, plan_model, limits=Limits.from_settings(settings)))
    if refused:
        raise UserError("; ".join(refused), WINDOW_FIXES)
