"""The command's exit codes, and how an error is printed (one or two lines on stderr).

What an error means is decided below the command line (worker.errors: a UserError, or an
Unavailable when something cannot be reached or found); the code a process exits with is the
command's business, decided here (``exit_code``) and documented in docs/cli.md.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

import typer

from worker.errors import Unavailable, UserError

# The exit codes, as the README documents them (docs/cli.md).
EXIT_OK = 0
EXIT_PARTIAL = 1  # the job ended `partial`: some sources, pages or answers failed, the rest is stored
EXIT_USAGE = 2  # a bad option, argument or input the user can fix (nothing was started)
EXIT_FAILED = 3  # the job ended `failed`: not one answer
EXIT_UNAVAILABLE = 4  # something the command needs cannot be reached or found: database, broker, S3, model
EXIT_INTERNAL = 5  # a bug in visbatch: the message says so, --debug shows the traceback
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C or SIGTERM; `visbatch resume JOB` continues

DEBUG_META_KEY = "visbatch.debug"


def exit_code(error: UserError) -> int:
    """4 for what cannot be reached or found (the command was right), else 2 (it can be fixed)."""
    return EXIT_UNAVAILABLE if isinstance(error, Unavailable) else EXIT_USAGE


def report(error: UserError) -> None:
    """Print the error's one or two lines on stderr (never wrapped: logs are grepped)."""
    typer.echo(f"error: {error.message}", err=True)
    if error.fix:
        typer.echo(f"fix: {error.fix}", err=True)


def debug_enabled(ctx: Any) -> bool:
    if os.environ.get("VISBATCH_DEBUG", "").lower() in ("1", "true", "yes"):
        return True
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and root.meta.get(DEBUG_META_KEY))


def is_broken_pipe(exc: BaseException) -> bool:
    return isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE)


def end_quietly_on_broken_pipe() -> int:
    """The reader of stdout went away (`visbatch results JOB | head -1`): stop as Unix tools do,
    silently, exit 0. Stdout is pointed at /dev/null so that the interpreter's last flush of what
    is still buffered does not fail again ("Exception ignored ... BrokenPipeError")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (embedded in another program): nothing to quiet
        pass
    return EXIT_OK
