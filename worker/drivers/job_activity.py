"""Why a running job does not move, in words: what `visbatch status` shows instead of an ETA.

Answers an operator can act on: "waiting: no worker on queue encode" (start one), "stalled: no
progress for 3m12s" (the fleet resumes it on its own: worker.drivers.fleet.stall_watch), and for
a job run in one process (`visbatch run`, `resume`, the Python API), "interrupted: the process
that ran it (pid N on HOST) is gone" (resumed by hand).

Such a run holds a lease on its job (storage.leases), renewed every few seconds: it is gone once
the lease has expired, wherever it ran. Its process is recorded too (`this_process`: host, pid,
start time, and the namespace key: this boot and PID namespace), so that a process known to be gone
is told at once, without waiting out the lease; but only where the pid provably means the same
process (the same PID namespace of the same boot), never by a host name that containers share. All
of it is derived when asked: a read-only command never changes the stored status. A job that moves
gets None, and its ETA.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from storage.models import utcnow
from visbatch.settings import Settings
from worker.drivers.fleet.consumers import start_hint

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
    messages: dict[str, int] | None = None,
) -> dict[str, Any] | None:
    """{"state": "waiting" | "quiet" | "stalled", "message": ..., "idle_seconds": ..., "queue": ...}
    for a running job that waits for a worker or a retry, has not moved for QUIET_S (a fleet job:
    what it waits for, from the first seconds), or for `stall_after_s`; None otherwise.

    `consumers` ({stage: workers}) and `messages` ({stage: messages waiting}) are asked of the
    broker (about a second at most) for a fleet job when not given; a broker that cannot tell
    gives no "waiting" answer.
    """
    if summary.get("status") != "running" or not summary.get("progress_at"):
        return None
    now = now or utcnow()
    idle = max(0.0, (now - datetime.fromisoformat(summary["progress_at"])).total_seconds())
    job_id = summary["id"]
    runner = None if summary.get("fleet") else parse_process(summary.get("process"))
    alive = None if runner is None else run_alive(runner, summary.get("lease"), now)
    if runner is not None and alive is False:
        return {
            "state": "interrupted",
            "queue": None,
            "idle_seconds": idle,
            "message": interrupted_message(job_id, runner),
        }
    waiting = _waiting(summary, now)
    if waiting is not None:
        return {"state": "waiting", "queue": None, "idle_seconds": idle, "message": waiting}
    outstanding = summary.get("outstanding") or {}
    needed = [stage for stage in STAGES if outstanding.get(stage)]
    if summary.get("fleet") and needed:
        if consumers is None:
            consumers, messages = _ask_broker(settings, needed)
        for stage in needed:
            if consumers.get(stage) == 0:
                return {
                    "state": "waiting",
                    "queue": stage,
                    "idle_seconds": idle,
                    "message": f"waiting: no worker on queue {stage}; {start_hint([stage])}",
                }
    # Alive by its lease, in a process this host cannot see (another host or container).
    elsewhere = runner is not None and alive and process_gone(runner) is None
    if summary.get("fleet") and needed and QUIET_S <= idle < settings.stall_after_s and messages is not None:
        return {"state": "quiet", "queue": None, "idle_seconds": idle,
                "message": _quiet(idle, needed, messages, settings.stall_after_s)}  # fmt: skip
    if idle < settings.stall_after_s:
        if elsewhere:
            assert runner is not None
            return {
                "state": "elsewhere",
                "queue": None,
                "idle_seconds": idle,
                "eta": True,  # it moves: its ETA stays
                "message": f"running in {where(runner)}{renewed(summary.get('lease'), now)}",
            }
        return None
    if summary.get("fleet"):
        then = f"the fleet resumes it automatically, or run visbatch resume {job_id}"
    elif runner is None or alive is None:
        then = f"if the process that ran it is gone, run visbatch resume {job_id}"
    else:
        then = (
            f"the process that runs it ({where(runner)}) is alive: stop it (Ctrl-C), "
            f"then run visbatch resume {job_id}"
        )
    return {
        "state": "stalled",
        "queue": None,
        "idle_seconds": idle,
        "message": f"stalled: no progress for {format_duration(idle)}; {then}",
    }


# A retry waits at most 90 s (60 s, jittered): a note older than this is no longer renewed.
WAITING_FRESH_S = 120.0


def _waiting(summary: dict[str, Any], now: datetime) -> str | None:
    """ "waiting: the disk is full (/data/store); ..." while the job's work is being retried and
    nothing has moved since (worker.stages.runner notes each retry's cause)."""
    note, at = summary.get("waiting"), summary.get("waiting_at")
    if not note or not at:
        return None
    noted = datetime.fromisoformat(at)
    age = (now - noted).total_seconds()
    moved = summary.get("progress_at") and datetime.fromisoformat(summary["progress_at"]) > noted
    if age > WAITING_FRESH_S or moved:
        return None
    return f"waiting: {note}; it is tried again on its own, nothing is failed for it"


# A fleet job quiet this long is told what it waits for (a worker busy with other work, or messages
# that a dead worker holds or that were lost), long before the stall watch acts.
QUIET_S = 20.0


def _quiet(idle: float, needed: list[str], messages: dict[str, int], stall_after_s: float) -> str:
    waiting = {stage: messages.get(stage, 0) for stage in needed if messages.get(stage)}
    quiet = f"no progress for {format_duration(idle)}"
    if waiting:
        queued = ", ".join(f"{n} in {stage}" for stage, n in waiting.items())
        return f"{quiet}; messages wait in its queues ({queued}): the workers are busy or starting"
    return (
        f"{quiet} and no message of it waits in a queue: a worker holds them (a dead worker's come "
        f"back once its heartbeat lapses) or they were lost; the stall watch sends them again "
        f"once a Redis broker shows none held, and resumes it at {format_duration(stall_after_s)}"
    )


def _ask_broker(settings: Settings, stages: list[str]) -> tuple[dict[str, int], dict[str, int] | None]:
    """({stage: consumers}, {stage: messages waiting}); empty and None when the broker cannot tell."""
    from worker.drivers.fleet.consumers import queue_states

    states = queue_states(settings, stages, timeout=1.0)
    if states is None:
        return {}, None
    return (
        {stage: state.consumers for stage, state in states.items()},
        {stage: state.messages for stage, state in states.items()},
    )


# --- the process that runs a job in one process -----------------------------------------------------


class Runner(NamedTuple):
    """The process that runs (or ran) a job in one process, as its job row records it."""

    host: str
    pid: int
    start: str  # its start time (a reused pid is another process); empty where unknown
    namespace: str  # namespace_key() where it ran; empty in rows of older versions


def interrupted_message(job_id: str, runner: Runner) -> str:
    return (
        f"interrupted: the process that ran it ({where(runner)}) is gone; "
        f"continue it: visbatch resume {job_id}"
    )


def where(runner: Runner) -> str:
    return f"pid {runner.pid} on {runner.host}"


def renewed(lease: dict[str, Any] | None, now: datetime | None = None) -> str:
    """ "; lease renewed 3 s ago" for a message, or nothing."""
    if not lease or not lease.get("renewed_at"):
        return ""
    ago = ((now or utcnow()) - datetime.fromisoformat(lease["renewed_at"])).total_seconds()
    return f"; lease renewed {max(0, int(ago))} s ago"


def shown_status(item: dict[str, Any]) -> str:
    """A job's status as `jobs` lists it: `interrupted` for a running job run in one process whose
    run is gone (derived; the stored status stays `running`)."""
    status = str(item.get("status"))
    if status != "running" or item.get("fleet"):
        return status
    runner = parse_process(item.get("process"))
    return "interrupted" if runner is not None and run_alive(runner, item.get("lease")) is False else status


def run_alive(runner: Runner, lease: dict[str, Any] | None, now: datetime | None = None) -> bool | None:
    """Whether the run of a running job is alive: where its pid provably means the same process
    (this machine, boot and PID namespace), whether that process runs; elsewhere, whether its
    lease is live (False once expired or let go); None when neither can tell (a row of an older
    version, with no lease, of a process elsewhere)."""
    gone = process_gone(runner)
    if gone is not None:
        return not gone
    if lease and lease.get("renewed_at"):
        expires = lease.get("expires_at")
        return bool(lease.get("held") and expires and datetime.fromisoformat(expires) > (now or utcnow()))
    return None


def this_process() -> str:
    """This process as a job row records it: "HOST:PID:START:NAMESPACE" (START empty where unknown)."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid) or ''}:{namespace_key()}"


def parse_process(value: str | None) -> Runner | None:
    """The recorded process; None for none (or a value it cannot read). Rows of older versions
    have no namespace ("HOST:PID:START")."""
    if not value:
        return None
    host, sep, rest = value.partition(":")
    parts = rest.split(":", 2)
    if not sep or len(parts) < 2 or not parts[0].isdigit():
        return None
    return Runner(host, int(parts[0]), parts[1], parts[2] if len(parts) > 2 else "")


@cache
def namespace_key() -> str:
    """Where a pid means one process: this boot of this machine and this PID namespace
    ("BOOT_ID/PIDNS_INODE"); containers on one host share the boot, not the namespace, and two
    machines never share a boot id. Without /proc (macOS), the host name (no PID namespaces)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return f"host={socket.gethostname()}"
    return f"{boot}/{namespace.removeprefix('pid:[').rstrip(']')}"


def process_gone(runner: Runner) -> bool | None:
    """True when the process is known to be gone (no such pid, a zombie, or another process under
    a reused pid), False when it runs, None when this process cannot tell (another machine, boot or
    PID namespace: a container; or a row of an older version)."""
    if not runner.namespace or runner.namespace != namespace_key() or os.name == "nt":
        return None
    pid, start = runner.pid, runner.start
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
