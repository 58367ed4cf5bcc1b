"""What the `visbatch` command says when something goes wrong, and with which exit code.

Every error a person can cause or meet ends the same way: one or two plain lines on stderr,
``error: <what and where>`` and, when there is one, ``fix: <what to do>``, then a documented exit
code. A traceback is only for ``--debug`` (or VISBATCH_DEBUG=1): a user who mistyped a database
URL needs the URL and the variable to change, not 500 lines of driver internals.

The translation lives in one place (``explain``), applied by the command group around every
command (worker.cli.group), so a new command gets it without a try/except of its own.
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

# The exit codes, as the README documents them (docs/cli.md).
EXIT_OK = 0
EXIT_PARTIAL = 1  # the job ended `partial`: some sources, pages or answers failed, the rest is stored
EXIT_USAGE = 2  # a bad option, argument or input the user can fix (nothing was started)
EXIT_FAILED = 3  # the job ended `failed`: not one answer
EXIT_UNAVAILABLE = 4  # something the command needs cannot be reached or found: database, broker, S3, model
EXIT_INTERNAL = 5  # a bug in visbatch: the message says so, --debug shows the traceback
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C or SIGTERM; `visbatch resume JOB` continues

EXIT_CODES = {
    EXIT_OK: "succeeded (every page/frame answered)",
    EXIT_PARTIAL: "partial: some sources, pages/frames or answers failed; the rest is stored",
    EXIT_USAGE: "bad option, argument or input; nothing was started",
    EXIT_FAILED: "the job failed: not one answer",
    EXIT_UNAVAILABLE: "a database, broker, object store or model could not be reached or found",
    EXIT_INTERNAL: "an unexpected error (a bug): run again with --debug and report it",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C, SIGTERM): the job is cancelled, `visbatch resume JOB` continues",
}

DEBUG_META_KEY = "visbatch.debug"


@dataclass
class UserError(Exception):
    """An error for a person: what went wrong (naming the thing) and how to fix it."""

    message: str
    fix: str | None = None
    code: int = EXIT_USAGE

    def __str__(self) -> str:
        return self.message


class Unavailable(UserError):
    """Something a call needs cannot be reached or found (database, broker, store, model): the
    Python API raises it where the command exits 4."""


def first_line(text: object) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _database_url() -> str:
    from storage.db import mask_url
    from visbatch.settings import Settings

    try:
        return mask_url(Settings().sqlalchemy_url())
    except Exception:  # noqa: BLE001 - a message must never fail: say what we can
        return "the database"


def database_described() -> tuple[str, str, str]:
    """(where, how, chosen_by): the database this process uses as a person finds it (the SQLite
    file's path, else the URL with its password masked), how it was chosen in words, and the
    variable that chose it ("" for the current folder's .visbatch: Settings.database_chosen_by).
    State depends on VISBATCH_HOME and on the folder a command runs in, so a message about the
    database names both."""
    from sqlalchemy.engine import make_url

    from storage.db import mask_url
    from visbatch.settings import Settings

    try:
        settings = Settings()
        url = make_url(settings.sqlalchemy_url())
        file = url.database if url.get_backend_name() == "sqlite" else None
        where = mask_url(url)
        if file and file != ":memory:" and not file.startswith("file:"):
            where = str(Path(file).expanduser().resolve())
        return where, settings.database_origin(), settings.database_chosen_by
    except Exception:  # noqa: BLE001 - a message must never fail: say what we can
        return "the database", "VISBATCH_DATABASE_URL, else $VISBATCH_HOME/visbatch.db", "?"


# How to reach the right database, by what chose the one that was not right.
_ELSEWHERE_FIX = {
    "": "run visbatch in the folder whose .visbatch holds your jobs, or point VISBATCH_HOME at that "
    ".visbatch folder (VISBATCH_DATABASE_URL at another database)",
    "VISBATCH_HOME": "point VISBATCH_HOME at the folder that holds your visbatch.db, or unset it to use "
    "the current folder's .visbatch (VISBATCH_DATABASE_URL: another database)",
    "VISBATCH_DATABASE_URL": "correct VISBATCH_DATABASE_URL",
}


def _not_ready(exc: Any) -> UserError:
    """No database where a reading command looked (storage.db.DatabaseNotReady): which one, how
    it was found, and the way to the right one. Exit 4: the command is right, what it needs is
    not found (as a database that is down)."""
    where, how, chosen_by = database_described()
    if exc.path is not None:  # no such SQLite file
        fix = _ELSEWHERE_FIX.get(chosen_by, _ELSEWHERE_FIX["VISBATCH_DATABASE_URL"])
        fix += "; a new one: `visbatch db upgrade`, or any `visbatch run`"
        return UserError(f"no visbatch database at {where} ({how})", fix, EXIT_UNAVAILABLE)
    return UserError(
        f"the database {where} {exc.reason} ({how})",
        "create or update its tables: visbatch db upgrade (or point VISBATCH_DATABASE_URL at "
        "visbatch's database)",
        EXIT_UNAVAILABLE,
    )


def explain(exc: BaseException) -> UserError | None:
    """A known failure as a UserError; None when it is not one we know (a bug)."""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno in _PATH_FIXES:
        return _path_error(exc)
    from storage.db import DatabaseNotReady, DatabaseUrlError

    if isinstance(exc, DatabaseNotReady):
        return _not_ready(exc)
    if isinstance(exc, DatabaseUrlError):
        return UserError(
            f"VISBATCH_DATABASE_URL {exc.url}: {exc.reason}",
            f"correct VISBATCH_DATABASE_URL: {DatabaseUrlError.SUPPORTED} (unset, it is a SQLite "
            "file under $VISBATCH_HOME)",
            EXIT_USAGE,
        )
    module = type(exc).__module__ or ""
    # The database (SQLAlchemy wraps the driver's error; the URL is masked: no password).
    if module.startswith("sqlalchemy"):
        from sqlalchemy.exc import DBAPIError

        if isinstance(exc, DBAPIError):
            return _database_error(exc)
    # The Celery broker (kombu) for `submit`, `cancel`, `worker`.
    if module.startswith(("kombu", "amqp")):
        from storage.db import mask_url
        from visbatch.settings import Settings

        return UserError(
            f"cannot reach the broker {mask_url(Settings().broker_url)}: {first_line(exc)}",
            "start it (RabbitMQ or Redis), or set VISBATCH_BROKER_URL",
            EXIT_UNAVAILABLE,
        )
    if module.startswith("redis"):
        return UserError(
            f"cannot reach Redis: {first_line(exc)}",
            "start it, or check VISBATCH_CACHE_URL and VISBATCH_BROKER_URL",
            EXIT_UNAVAILABLE,
        )
    # S3 (botocore): unreachable endpoint, no credentials, no bucket.
    if module.startswith(("botocore", "boto3")):
        return UserError(
            f"cannot use the object store: {first_line(exc)}",
            "check VISBATCH_S3_ENDPOINT_URL, the bucket in VISBATCH_STORE_URL / VISBATCH_CACHE_COLD_URL, "
            "and the AWS credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE ...)",
            EXIT_UNAVAILABLE,
        )
    from ingest.token_rules import ModelFilesUnavailable, UnsupportedModel

    if isinstance(exc, ModelFilesUnavailable):
        return UserError(str(exc), MODEL_FIX, EXIT_UNAVAILABLE)
    if isinstance(exc, UnsupportedModel):
        return UserError(str(exc), "use a model of a supported family (docs/engines.md)", EXIT_USAGE)
    from storage.sql import JobNotFound, NotFound
    from visbatch.settings import SettingError

    if isinstance(exc, SettingError):
        return UserError(
            str(exc), "correct or unset that variable (docs/cli.md lists every setting)", EXIT_USAGE
        )
    from storage.leases import LeaseHeld

    if isinstance(exc, LeaseHeld):
        return UserError(
            str(exc),
            "stop it there (Ctrl-C) or let it finish; resume takes over only a run that is gone "
            "(its process ended here, or its lease expired: no renewal for VISBATCH_LEASE_S)",
            EXIT_USAGE,
        )
    if isinstance(exc, JobNotFound) and str(exc).startswith("no job "):
        # Where it looked: a job run from another folder lives in that folder's .visbatch.
        where, how, chosen_by = database_described()
        fix = "`visbatch jobs` lists the jobs there"
        if not chosen_by:
            fix += "; a job run in another folder is in that folder's .visbatch (run there, or set "
            fix += "VISBATCH_HOME)"
        return UserError(f"{exc} in {where} ({how})", fix, EXIT_USAGE)
    if isinstance(exc, NotFound):
        return UserError(str(exc), "`visbatch jobs` lists the recent jobs", EXIT_USAGE)
    return None


def _database_error(exc: Any) -> UserError:
    reason = first_line(exc.orig or exc)
    # Reachable, but not migrated (an empty file, or a database of an older visbatch).
    if "no such table" in reason or "UndefinedTable" in type(exc.orig).__name__:
        return UserError(
            f"the database {_database_url()} holds no visbatch tables: {reason}",
            "run `visbatch db upgrade`, or point VISBATCH_DATABASE_URL at visbatch's database",
            EXIT_UNAVAILABLE,
        )
    return UserError(
        f"cannot use the database {_database_url()}: {reason}",
        "start the database server, or point VISBATCH_DATABASE_URL at a reachable one "
        "(unset, it is a SQLite file under $VISBATCH_HOME)",
        EXIT_UNAVAILABLE,
    )


# A path the user gave (an output file or folder, an input) that cannot be used: the errno's
# fix. Only these: another OSError (a full pipe, a reset socket) is not about a path.
_PATH_FIXES = {
    errno.ENOENT: "create the folder first, or choose a path in a folder that exists",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
    errno.EACCES: "choose a path you may write to, or change its permissions",
    errno.EPERM: "choose a path you may write to, or change its permissions",
    errno.EROFS: "the file system is read-only: choose a path on another one",
    errno.EISDIR: "that is a folder: give a file name",
    errno.EEXIST: "choose another path, or remove what is there",
    errno.ENOSPC: "free some disk space, or choose a path on another disk",
    errno.ENAMETOOLONG: "choose a shorter path",
}


def _path_error(exc: OSError) -> UserError:
    reason = (exc.strerror or type(exc).__name__).lower()
    if exc.errno == errno.ENOENT:
        # Name the folder that is missing: the file itself is missing because it is not written yet.
        missing = os.path.dirname(os.path.abspath(os.fsdecode(exc.filename)))
        while missing and not os.path.exists(os.path.dirname(missing)) and missing != "/":
            missing = os.path.dirname(missing)
        if missing and not os.path.exists(missing):
            reason = f"the folder {missing} does not exist"
    fix = _PATH_FIXES[exc.errno or 0]
    if exc.errno == errno.EEXIST and os.path.isfile(exc.filename):  # mkdir over a file
        reason, fix = "a file, not a folder", _PATH_FIXES[errno.ENOTDIR]
    return UserError(f"{os.fsdecode(exc.filename)}: {reason}", fix, EXIT_USAGE)


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


MODEL_FIX = (
    "give a local model folder: --model DIR, or `visbatch model use DIR` to make it this folder's "
    "default; to try visbatch offline: `visbatch model tiny .visbatch/tiny-model && "
    "visbatch model use .visbatch/tiny-model` (random weights: meaningless answers)"
)


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
