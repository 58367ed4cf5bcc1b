"""Why a running job does not move, in words: what `visbatch status` shows instead of an ETA.

Two answers an operator can act on: "waiting: no worker on queue encode" (start one), and
"stalled: no progress for 3m12s" (the fleet resumes it on its own: worker.stall_watch; a job run in
one process whose process is gone is resumed by hand). A job that moves gets None, and its ETA.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from storage.models import utcnow
from storage.settings import Settings
from worker.consumers import start_hint

STAGES = ("ingest", "encode", "generate")


def format_duration(seconds: float) -> str:
    """3m12s, 1h05m, 45s: how long a job has not moved, as an operator reads it."""
    total = max(0, int(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def job_activity(
    settings: Settings,
    summary: dict[str, Any],
    *,
    now: datetime | None = None,
    consumers: dict[str, int] | None = None,
) -> dict[str, Any] | None:
    """{"state": "waiting" | "stalled", "message": ..., "idle_seconds": ..., "queue": ...} for a
    running job that waits for a worker or has not moved for `stall_after_s`; None otherwise.

    `consumers` ({stage: workers}) is asked of the broker (about a second at most) for a fleet job
    when not given; a broker that cannot tell gives no "waiting" answer.
    """
    if summary.get("status") != "running" or not summary.get("progress_at"):
        return None
    now = now or utcnow()
    idle = max(0.0, (now - datetime.fromisoformat(summary["progress_at"])).total_seconds())
    outstanding = summary.get("outstanding") or {}
    needed = [stage for stage in STAGES if outstanding.get(stage)]
    if summary.get("fleet") and needed:
        if consumers is None:
            consumers = _ask_broker(settings, needed)
        for stage in needed:
            if consumers.get(stage) == 0:
                return {
                    "state": "waiting",
                    "queue": stage,
                    "idle_seconds": idle,
                    "message": f"waiting: no worker on queue {stage}; {start_hint([stage])}",
                }
    if idle < settings.stall_after_s:
        return None
    job_id = summary["id"]
    then = (
        f"the fleet resumes it automatically, or run visbatch resume {job_id}"
        if summary.get("fleet")
        else f"if the process that ran it is gone, run visbatch resume {job_id}"
    )
    return {
        "state": "stalled",
        "queue": None,
        "idle_seconds": idle,
        "message": f"stalled: no progress for {format_duration(idle)}; {then}",
    }


def _ask_broker(settings: Settings, stages: list[str]) -> dict[str, int]:
    from worker.consumers import queue_states

    states = queue_states(settings, stages, timeout=1.0)
    return {} if states is None else {stage: state.consumers for stage, state in states.items()}
