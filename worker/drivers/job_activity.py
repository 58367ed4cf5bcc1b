"""Why a running job does not move, in words: what `visbatch status` shows instead of an ETA.

Answers an operator can act on: "waiting: no worker on queue encode" (start one), "stalled: no
progress for 3m12s" (the fleet resumes it on its own: worker.drivers.stall_watch), and for a job run in one
process (`visbatch run`, `resume`, the Python API), "interrupted: the process that ran it (pid N on
HOST) is gone" (resumed by hand). That process is recorded in the job row (`this_process`: host, pid
and start time, so that a reused pid is not taken for it); whether it is gone can be told on its own
host only, and is derived when asked: a read-only command never changes the stored status. A job
that moves gets None, and its ETA.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

from storage.models import utcnow
from visbatch.settings import Settings
from worker.drivers.consumers import start_hint

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
    job_id = summary["id"]
    runner = None if summary.get("fleet") else parse_process(summary.get("process"))
    gone = None if runner is None else process_gone(*runner)
    if runner is not None and gone:
        return {
            "state": "interrupted",
            "queue": None,
            "idle_seconds": idle,
            "message": interrupted_message(job_id, runner),
        }
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
    elsewhere = runner is not None and gone is None  # run on another host: cannot be told here
    if idle < settings.stall_after_s:
        if elsewhere:
            assert runner is not None
            return {
                "state": "elsewhere",
                "queue": None,
                "idle_seconds": idle,
                "eta": True,  # it moves: its ETA stays
                "message": f"running on {runner[0]} (pid {runner[1]}); whether that process is "
                "alive cannot be told from this host",
            }
        return None
    if summary.get("fleet"):
        then = f"the fleet resumes it automatically, or run visbatch resume {job_id}"
    elif runner is None:
        then = f"if the process that ran it is gone, run visbatch resume {job_id}"
    elif elsewhere:
        then = (
            f"if the process that ran it (pid {runner[1]} on {runner[0]}) is gone, "
            f"run visbatch resume {job_id}"
        )
    else:
        then = (
            f"the process that runs it (pid {runner[1]}) is alive: stop it (Ctrl-C), then "
            f"run visbatch resume {job_id}"
        )
    return {
        "state": "stalled",
        "queue": None,
        "idle_seconds": idle,
        "message": f"stalled: no progress for {format_duration(idle)}; {then}",
    }


def _ask_broker(settings: Settings, stages: list[str]) -> dict[str, int]:
    from worker.drivers.consumers import queue_states

    states = queue_states(settings, stages, timeout=1.0)
    return {} if states is None else {stage: state.consumers for stage, state in states.items()}


# --- the process that runs a job in one process -----------------------------------------------------


def interrupted_message(job_id: str, runner: tuple[str, int, str]) -> str:
    host, pid, _ = runner
    return (
        f"interrupted: the process that ran it (pid {pid} on {host}) is gone; "
        f"continue it: visbatch resume {job_id}"
    )


def shown_status(item: dict[str, Any]) -> str:
    """A job's status as `jobs` lists it: `interrupted` for a running job run in one process on
    this host whose process is gone (derived; the stored status stays `running`)."""
    status = str(item.get("status"))
    if status != "running" or item.get("fleet"):
        return status
    runner = parse_process(item.get("process"))
    return "interrupted" if runner is not None and process_gone(*runner) else status


def this_process() -> str:
    """This process as a job row records it: "HOST:PID:START" (START empty where unknown)."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid) or ''}"


def parse_process(value: str | None) -> tuple[str, int, str] | None:
    """(host, pid, start) of a recorded process; None for none (or a value it cannot read)."""
    if not value:
        return None
    parts = value.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


def process_gone(host: str, pid: int, start: str) -> bool | None:
    """True when the process is known to be gone (no such pid, a zombie, or another process under
    a reused pid), False when it runs, None when this host cannot tell (another host)."""
    if host != socket.gethostname() or os.name == "nt":
        return None
    stat = _proc_stat(pid)
    if stat is not None:
        if not stat:  # /proc is there, this pid is not
            return True
        state, started = stat
        return state in ("Z", "X") or bool(start and started != start)
    try:  # no /proc (macOS): ask the kernel whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, under another user
    except OSError:
        return None
    started = _start_time(pid)
    return bool(start and started and started != start)


def _proc_stat(pid: int) -> tuple[str, str] | tuple[()] | None:
    """(state, start time in clock ticks since boot) from /proc/PID/stat; () when /proc has no such
    process; None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ()
    except OSError:
        return None
    # "PID (COMM) STATE ...": COMM may hold spaces and parentheses; fields resume after the last ")".
    fields = text[text.rfind(")") + 2 :].split()
    return (fields[0], fields[19]) if len(fields) > 19 else None


def _start_time(pid: int) -> str | None:
    stat = _proc_stat(pid)
    if stat:
        return stat[1]
    if stat == ():
        return None
    with contextlib.suppress(Exception):  # psutil where it is installed (it is optional)
        import psutil

        return f"{psutil.Process(pid).create_time():.2f}"
    return None
