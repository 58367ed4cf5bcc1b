"""What a person is told when something goes wrong: what and where, and how to fix it.

Every error a person can cause or meet ends the same way: a ``UserError`` (an ``Unavailable``
when something needed cannot be reached or found) with ``message`` naming the thing and ``fix``.
The command prints it in two plain lines and exits with its code (worker.cli.exits: 2, or 4 for
Unavailable); the Python API raises it as ``visbatch.Error``. A traceback is only for
``--debug``: a user who mistyped a database URL needs the URL and the variable to change, not 500
lines of driver internals.

The translation of known failures lives in one place (``explain``), applied by the command
group around every command (worker.cli.group) and by the Python API around every call, so a new
command gets it without a try/except of its own. Nothing here knows the command line.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class UserError(Exception):
    """An error for a person: what went wrong (naming the thing) and how to fix it."""

    message: str
    fix: str | None = None

    def __str__(self) -> str:
        return self.message


class Unavailable(UserError):
    """Something a call needs cannot be reached or found (database, broker, store, model): the
    command is right and may work later (exit 4)."""


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
        return Unavailable(f"no visbatch database at {where} ({how})", fix)
    return Unavailable(
        f"the database {where} {exc.reason} ({how})",
        "create or update its tables: visbatch db upgrade (or point VISBATCH_DATABASE_URL at "
        "visbatch's database)",
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
        )
    from storage.object_store import StoreUrlError

    if isinstance(exc, StoreUrlError):
        setting = exc.setting or "VISBATCH_STORE_URL or VISBATCH_CACHE_COLD_URL"
        return UserError(f"{exc.setting or 'object store URL'} {exc.url}: {exc.reason}",
                         f"correct {setting}: {StoreUrlError.FORMS}")  # fmt: skip
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

        return Unavailable(
            f"cannot reach the broker {mask_url(Settings().broker_url)}: {first_line(exc)}",
            "start it (RabbitMQ or Redis), or set VISBATCH_BROKER_URL",
        )
    if module.startswith("redis"):
        return Unavailable(
            f"cannot reach Redis: {first_line(exc)}",
            "start it, or check VISBATCH_CACHE_URL and VISBATCH_BROKER_URL",
        )
    # S3 (botocore): unreachable endpoint, no credentials, no bucket.
    if module.startswith(("botocore", "boto3")):
        return Unavailable(
            f"cannot use the object store: {first_line(exc)}",
            "check VISBATCH_S3_ENDPOINT_URL, the bucket in VISBATCH_STORE_URL / VISBATCH_CACHE_COLD_URL, "
            "and the AWS credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE ...)",
        )
    from ingest.token_rules import ModelFilesUnavailable, UnsupportedModel

    if isinstance(exc, ModelFilesUnavailable):
        return Unavailable(str(exc), MODEL_FIX)
    if isinstance(exc, UnsupportedModel):
        return UserError(str(exc), "use a model of a supported family (docs/engines.md)")
    from storage.sql import JobNotFound, NotFound
    from visbatch.settings import SettingError

    if isinstance(exc, SettingError):
        return UserError(str(exc), "correct or unset that variable (docs/cli.md lists every setting)")
    from storage.leases import LeaseHeld

    if isinstance(exc, LeaseHeld):
        return UserError(
            str(exc),
            "stop it there (Ctrl-C) or let it finish; resume takes over only a run that is gone "
            "(its process ended here, or its lease expired: no renewal for VISBATCH_LEASE_S)",
        )
    if isinstance(exc, JobNotFound) and str(exc).startswith("no job "):
        # Where it looked: a job run from another folder lives in that folder's .visbatch.
        where, how, chosen_by = database_described()
        fix = "`visbatch jobs` lists the jobs there"
        if not chosen_by:
            fix += "; a job run in another folder is in that folder's .visbatch (run there, or set "
            fix += "VISBATCH_HOME)"
        return UserError(f"{exc} in {where} ({how})", fix)
    if isinstance(exc, NotFound):
        return UserError(str(exc), "`visbatch jobs` lists the recent jobs")
    return None


def _database_error(exc: Any) -> UserError:
    reason = first_line(exc.orig or exc)
    # Reachable, but not migrated (an empty file, or a database of an older visbatch).
    if "no such table" in reason or "UndefinedTable" in type(exc.orig).__name__:
        return Unavailable(
            f"the database {_database_url()} holds no visbatch tables: {reason}",
            "run `visbatch db upgrade`, or point VISBATCH_DATABASE_URL at visbatch's database",
        )
    return Unavailable(
        f"cannot use the database {_database_url()}: {reason}",
        "start the database server, or point VISBATCH_DATABASE_URL at a reachable one "
        "(unset, it is a SQLite file under $VISBATCH_HOME)",
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
    return UserError(f"{os.fsdecode(exc.filename)}: {reason}", fix)


MODEL_FIX = (
    "give a local model folder: --model DIR, or `visbatch model use DIR` to make it this folder's "
    "default; to try visbatch offline: `visbatch model tiny .visbatch/tiny-model && "
    "visbatch model use .visbatch/tiny-model` (random weights: meaningless answers)"
)
