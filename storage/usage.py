"""What this process asks of the database and the broker, counted: capacity tests only.

Off by default. With ``VISBATCH_USAGE_DIR`` set (visbatch.settings declares it; read here once,
at import), every process that opens a database or publishes a Celery task counts:

- SQL: statements by verb and first table (an ``executemany`` is one statement), parameter sets,
  transactions committed and rolled back, rows written (the driver's rowcount of INSERT, UPDATE,
  DELETE), connections opened, pool checkouts (each one a pre-ping round trip on PostgreSQL);
- Celery: messages published (``before_task_publish``) and taken to run (``task_prerun``), by task.

and writes them to ``<dir>/<pid>.json``: at most twice a second from a daemon thread while they
change, and at exit. bench/unit_costs.py and bench/control_plane.py sum the files of all
processes. When off, nothing is installed: no event listener, no signal handler, no thread.
The cost when on is a dict increment per statement (a lock-free counter under the GIL).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from visbatch.settings import SETTINGS

ENV = SETTINGS["usage_dir"].env  # VISBATCH_USAGE_DIR, declared with the other settings
DIRECTORY: Path | None = Path(os.environ[ENV]) if os.environ.get(ENV) else None
FLUSH_SECONDS = 0.5

_counts: Counter[str] = Counter()
_owner = 0  # the pid the counts belong to (a forked child starts from zero)
_lock = threading.Lock()
_written = -1  # the total the file holds


def enabled() -> bool:
    return DIRECTORY is not None


def add(key: str, n: int = 1) -> None:
    """Count `n` of `key` in this process (a no-op when counting is off)."""
    if DIRECTORY is None:
        return
    _ensure_process()
    _counts[key] += n


def snapshot() -> dict[str, int]:
    return dict(_counts)


def _ensure_process() -> None:
    """The first count of a process (or of a forked child) starts its writer thread."""
    global _owner, _written
    pid = os.getpid()
    if _owner == pid:
        return
    with _lock:
        if _owner == pid:
            return
        _counts.clear()  # a child forked from a counting parent: its own counts only
        _owner, _written = pid, -1
        threading.Thread(target=_writer, name="usage-counts", daemon=True).start()
        atexit.register(write)


def _writer() -> None:
    while True:
        time.sleep(FLUSH_SECONDS)
        write()


def write() -> None:
    """This process's counts to <dir>/<pid>.json (atomically: a reader never sees half a file)."""
    global _written
    if DIRECTORY is None or _owner != os.getpid():
        return
    counts = dict(_counts)
    total = sum(counts.values())
    if total == _written:
        return
    DIRECTORY.mkdir(parents=True, exist_ok=True)
    target = DIRECTORY / f"{os.getpid()}.json"
    partial = target.with_suffix(".tmp")
    partial.write_text(json.dumps({"pid": os.getpid(), "counts": counts}))
    partial.replace(target)
    _written = total


# --- SQL --------------------------------------------------------------------------------------

_WRITES = ("INSERT", "UPDATE", "DELETE")
# The first table a statement names: the breakdown by table says which statement a count is.
_TABLE = re.compile(r"\b(?:FROM|INTO|UPDATE)\s+\"?(\w+)", re.IGNORECASE)


def watch_engine(engine: Any) -> None:
    """Count what `engine` (a SQLAlchemy Engine) sends; nothing when counting is off."""
    if DIRECTORY is None:
        return
    from sqlalchemy import event

    @event.listens_for(engine, "after_cursor_execute")
    def _statement(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "?"
        add("sql.statements")
        add(f"sql.{verb.lower()}")
        table = _TABLE.search(statement)
        add(f"sql.by_table.{verb.lower()} {table.group(1) if table else '-'}")
        if executemany:
            add("sql.param_sets", len(parameters) if isinstance(parameters, list | tuple) else 1)
        if verb in _WRITES and getattr(cursor, "rowcount", -1) > 0:
            add("sql.rows_written", cursor.rowcount)

    @event.listens_for(engine, "commit")
    def _commit(conn) -> None:  # noqa: ANN001
        add("sql.commits")

    @event.listens_for(engine, "rollback")
    def _rollback(conn) -> None:  # noqa: ANN001
        add("sql.rollbacks")

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, record) -> None:  # noqa: ANN001
        add("sql.connections")

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection, record, proxy) -> None:  # noqa: ANN001
        # On PostgreSQL (pool_pre_ping) every checkout is a `SELECT 1` round trip that no
        # statement event sees: counted here.
        add("sql.checkouts")


# --- Celery -----------------------------------------------------------------------------------


def watch_celery() -> None:
    """Count the task messages this process publishes and runs; nothing when counting is off."""
    if DIRECTORY is None:
        return
    from celery.signals import before_task_publish, task_prerun

    def published(sender: str | None = None, **_: object) -> None:
        add("celery.published")
        add(f"celery.published.{(sender or '?').rsplit('.', 1)[-1]}")

    def ran(sender: Any = None, **_: object) -> None:
        add("celery.consumed")
        add(f"celery.consumed.{getattr(sender, 'name', '?').rsplit('.', 1)[-1]}")

    before_task_publish.connect(published, weak=False)
    task_prerun.connect(ran, weak=False)
