"""Keeps a `visbatch worker` consuming: the Celery worker runs in a child process, restarted when
it dies.

Why a supervisor and not a setting: kombu's Redis transport crashes the worker when the broker
restarts while messages are unacknowledged (celery#4652, kombu#582; reproduced with celery and
kombu 5.7: the consumer's connection error handler closes the channel, whose "restore unacked"
reads a connection that is already None -> `Unrecoverable error: AttributeError(... 'hostname')`
and the process exits). No option avoids that path, so `visbatch worker` restarts its consumer
instead of leaving a host without a worker until a person notices.

What it does:
- a child that exits unexpectedly (any exit the supervisor did not ask for) is started again
  after a short backoff, with its exit cause logged;
- SIGTERM or SIGINT to the supervisor is a warm shutdown of the child (SIGTERM: it finishes or
  returns its messages), the supervisor waits for it and exits with its code; a second signal
  asks for a cold one (SIGQUIT);
- a child that keeps exiting soon after starting (bad settings, a broker that refuses it) is not
  restarted forever: after `max_quick_exits` in a row the supervisor exits non-zero with the
  reason; a child exiting with EX_CONFIG (78) said that it can never work here (its model cannot
  load): not restarted at all;
- the child dies with the supervisor (PR_SET_PDEATHSIG), so no orphan consumer is left behind.

No Celery, torch or transformers is imported here: the supervisor stays small.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

# sysexits' EX_CONFIG: the child cannot work with this configuration (e.g. its model cannot load).
EX_CONFIG = 78


@dataclass(frozen=True)
class RestartPolicy:
    quick_exit_s: float = 30.0  # a child that dies sooner than this counts towards a crash loop
    max_quick_exits: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0

    def backoff(self, quick_exits: int) -> float:
        return min(self.backoff_max_s, self.backoff_base_s * 2 ** max(0, quick_exits - 1))


def exit_cause(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def shell_code(returncode: int) -> int:
    """A child's return code as this process's exit status (a signal: 128 + its number)."""
    return 128 - returncode if returncode < 0 else returncode


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when its parent dies, however it dies (Linux; the
    parent is the thread that started it, so start long-lived children from the main thread)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    def __init__(
        self, argv: Sequence[str], env: dict[str, str] | None = None, policy: RestartPolicy | None = None
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.policy = policy or RestartPolicy()
        self.child: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self._signals = 0

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        self.stopping.set()
        child = self.child
        if child is None or child.poll() is not None:
            return
        # The first signal is a warm shutdown, whatever it was (a terminal's Ctrl-C also reaches
        # the child itself, as SIGINT); a second one is a cold shutdown.
        forward = signal.SIGTERM if self._signals == 1 else signal.SIGQUIT
        log.info("%s: stopping the worker process %d (%s)", signal.Signals(signum).name, child.pid,
                 "warm" if forward == signal.SIGTERM else "cold")  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(forward)

    def run(self) -> int:
        """Run the child until asked to stop or until it cannot be kept up; the exit status."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        quick_exits = 0
        while not self.stopping.is_set():
            started = time.monotonic()
            self.child = subprocess.Popen(self.argv, env=self.env, preexec_fn=die_with_parent)  # noqa: PLW1509
            log.info("worker process %d started", self.child.pid)
            if self.stopping.is_set():  # a signal between the start and the line above
                self.child.send_signal(signal.SIGTERM)
            returncode = self.child.wait()
            lived = time.monotonic() - started
            if self.stopping.is_set():
                log.info("worker process %d stopped (%s)", self.child.pid, exit_cause(returncode))
                return shell_code(returncode)
            if returncode == EX_CONFIG:
                log.error("worker process %d cannot work with this configuration (exit code %d, the "
                          "reason is logged above): not restarting", self.child.pid, returncode)  # fmt: skip
                return EX_CONFIG
            quick_exits = quick_exits + 1 if lived < self.policy.quick_exit_s else 0
            if quick_exits >= self.policy.max_quick_exits:
                log.error("worker process exited %d times in a row within %.0f s of starting (last: %s): "
                          "giving up; the cause is logged above", quick_exits, self.policy.quick_exit_s,
                          exit_cause(returncode))  # fmt: skip
                return shell_code(returncode) or 1
            wait = self.policy.backoff(quick_exits)
            log.warning("worker process %d exited unexpectedly (%s) after %.1f s: restarting in %.1f s",
                        self.child.pid, exit_cause(returncode), lived, wait)  # fmt: skip
            self.stopping.wait(wait)
        return 0
