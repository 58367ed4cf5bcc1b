"""The database handle: one engine, short transactions, and migrations run from code.

The same class serves the embedded shape (a SQLite file) and the fleet (PostgreSQL); the URL
decides. Passwords never leave this module: ``repr`` and logs use the masked URL.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url

from storage import usage

log = logging.getLogger(__name__)

# How long a SQLite writer waits for the file lock before "database is locked".
SQLITE_BUSY_TIMEOUT_S = 30.0
# PRAGMA takes no bound parameters; this one is built once from a constant.
_BUSY_TIMEOUT_PRAGMA = f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}"
# Serialises concurrent `upgrade()` calls from many fleet workers starting at once
# (an arbitrary constant: "visbatch" in ASCII).
_PG_MIGRATION_LOCK = 0x7669736261746368
# Execution option that asks the SQLite BEGIN hook for a write lock up front.
_WRITE_OPTION = "visbatch_write"


def migrations_folder() -> Path:
    """The installed ``migrations`` package folder (independent of the working directory), found
    without importing it: the migrations import storage, not the other way round."""
    spec = importlib.util.find_spec("migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the migrations package is not installed beside storage")
    return Path(spec.submodule_search_locations[0]).resolve()


def head_revision() -> str:
    """The newest migration's revision id: the number its file name starts with (a test checks
    that the files are numbered one after another and that the newest is Alembic's head)."""
    files = sorted(p.name for p in (migrations_folder() / "versions").glob("[0-9][0-9][0-9][0-9]_*.py"))
    return files[-1][:4]


def mask_url(url: str | URL) -> str:
    return make_url(url).render_as_string(hide_password=True)


class DatabaseUrlError(ValueError):
    """A database URL that names no database visbatch can open: a typo in the scheme
    (``postgresl://``), a driver that is not installed (``mysql://``), or no URL at all."""

    SUPPORTED = "sqlite:///PATH or postgresql://USER:PASSWORD@HOST:5432/DB (postgresql+psycopg://)"

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


def _shown(url: str | URL) -> str:
    try:
        return mask_url(url)
    except Exception:  # noqa: BLE001 - unparsable: say it, but never its password
        text = str(url)
        return text.split("://", 1)[0] + "://..." if "://" in text else "(not a URL)"


def _engine(url: str | URL, **kwargs: Any) -> Engine:
    """create_engine, with a URL mistake as DatabaseUrlError (SQLAlchemy names a plugin or a
    missing driver module, never the setting to change)."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        return create_engine(url, **kwargs)
    except NoSuchModuleError:
        scheme = str(url).split("://", 1)[0]
        raise DatabaseUrlError(_shown(url), f"unknown database scheme {scheme!r}") from None
    except ImportError as exc:
        scheme = str(url).split("://", 1)[0]
        raise DatabaseUrlError(
            _shown(url), f"{scheme!r} needs the driver {exc.name or exc}, which is not installed"
        ) from None
    except ArgumentError as exc:
        raise DatabaseUrlError(_shown(url), str(exc).splitlines()[0]) from None


class DatabaseNotReady(LookupError):
    """No database a command that only reads can read at its URL: no such SQLite file, no
    visbatch tables, or tables of an older migration. Nothing was created or migrated: reading
    commands (`status`, `jobs`, `results` ...) never make the database they look for, so a typo or
    another current folder is told, not answered with an empty one.

    ``path``: the SQLite file that does not exist (None for the other cases); ``revision``: the
    migration the database is at (None: no visbatch tables)."""

    def __init__(self, url: str, reason: str, *, path: Path | None = None, revision: str | None = None):
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.path = path
        self.revision = revision


class Migrated(NamedTuple):
    """What `ensure_schema` did: from the revision the database was at (None: empty) to the head."""

    from_revision: str | None
    to_revision: str


class Database:
    """The engine of one database URL, and its transactions.

    A transaction is a Core ``Connection`` inside BEGIN ... COMMIT: every storage module speaks
    Core SQL (no ORM, whose import alone costs a read-only command a tenth of a second).
    """

    def __init__(self, url: str, *, echo: bool = False, create: bool = True) -> None:
        """``create=False``: a SQLite file that does not exist is DatabaseNotReady, and neither it
        nor its folder is made (connecting would create an empty one)."""
        try:
            self.url: URL = make_url(url)
        except Exception as exc:  # ArgumentError, ValueError: not a URL at all
            raise DatabaseUrlError(_shown(url), "not a database URL") from exc
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        engine_kwargs: dict[str, Any] = {"echo": echo}
        if self.is_sqlite:
            if create:
                self._make_sqlite_folder()
            else:
                self._require_sqlite_file()
            engine_kwargs["connect_args"] = {"timeout": SQLITE_BUSY_TIMEOUT_S}
        else:
            # Fleet connections sit idle between tasks; a server restart must not break the next task.
            engine_kwargs["pool_pre_ping"] = True
        self.engine: Engine = _engine(self.url, **engine_kwargs)
        if self.is_sqlite:
            _install_sqlite_hooks(self.engine)
        usage.watch_engine(self.engine)  # capacity tests only: a no-op unless VISBATCH_USAGE_DIR
        self._writer = self.engine.execution_options(**{_WRITE_OPTION: True})
        log.debug("database %s", self.masked_url)

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)

    def __repr__(self) -> str:
        return f"Database({self.masked_url!r})"

    @property
    def sqlite_path(self) -> Path | None:
        """The SQLite file (absolute), None for an in-memory or URI database or a server."""
        database = self.url.database
        if not self.is_sqlite or not database or database == ":memory:" or database.startswith("file:"):
            return None
        return Path(database).expanduser().resolve()

    def _make_sqlite_folder(self) -> None:
        if self.sqlite_path is not None:
            self.sqlite_path.parent.mkdir(parents=True, exist_ok=True)

    def _require_sqlite_file(self) -> None:
        path = self.sqlite_path
        if path is not None and not path.exists():
            raise DatabaseNotReady(self.masked_url, f"no such file: {path}", path=path)

    @contextmanager
    def session(self, *, readonly: bool = False) -> Iterator[Connection]:
        """One transaction: commit on success, roll back on any error (or an abandoned generator).

        ``readonly=True`` is a hint for SQLite: a writer takes the file's write lock at BEGIN
        (``BEGIN IMMEDIATE``) so that a read-then-write transaction can never fail half-way with
        "database is locked"; a reader does not, so long reads never block the pipeline.
        """
        engine = self.engine if readonly else self._writer
        # begin(): COMMIT when the block ends, ROLLBACK on any exception (GeneratorExit included).
        with engine.begin() as connection:
            yield connection

    def upgrade(self, revision: str = "head") -> None:
        """Run Alembic migrations up to ``revision`` on this database."""
        self._run_alembic("upgrade", revision)

    def current_revision(self) -> str | None:
        """The migration the database is at (None: an empty database, or not one of ours)."""
        try:
            with self.engine.connect() as connection:
                return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except Exception:  # no alembic_version table yet
            return None

    def ensure_schema(self) -> Migrated | None:
        """Migrate to the newest revision unless the database is already there: what it migrated,
        None when nothing was to be done (one SELECT: no Alembic imported).

        For the commands that start work (`run`, `submit`, a worker): they create the database they
        are pointed at. Commands that only read use `require_schema` instead.
        """
        before = self.current_revision()
        head = head_revision()
        if before == head:
            return None
        self.upgrade()
        return Migrated(before, head)

    def require_schema(self) -> str:
        """The revision the database is at; DatabaseNotReady (nothing changed) when it holds no
        visbatch tables or an older migration than this visbatch reads. A database that cannot be
        reached raises the driver's error (a server down is not "no tables")."""
        from sqlalchemy import inspect

        with self.engine.connect() as connection:
            revision = None
            if inspect(connection).has_table("alembic_version"):
                revision = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
        head = head_revision()
        if revision is None:
            raise DatabaseNotReady(self.masked_url, "holds no visbatch tables")
        if revision < head:  # numbered 0001, 0002 ... (head_revision): a newer one reads as well
            raise DatabaseNotReady(
                self.masked_url,
                f"is at migration {revision}, older than this visbatch's {head}",
                revision=revision,
            )
        return revision

    def downgrade(self, revision: str) -> None:
        """Run Alembic migrations down to ``revision`` ("base" drops everything)."""
        self._run_alembic("downgrade", revision)

    def alembic_config(self) -> Any:
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(migrations_folder()))
        config.set_main_option("path_separator", "os")
        # ConfigParser interpolates "%": URL escapes such as %3D must be doubled.
        url = self.url.render_as_string(hide_password=False).replace("%", "%%")
        config.set_main_option("sqlalchemy.url", url)
        return config

    def _run_alembic(self, command_name: str, revision: str) -> None:
        from alembic import command

        config = self.alembic_config()
        log.info("alembic %s %s on %s", command_name, revision, self.masked_url)
        with self.migration_connection() as connection:
            # env.py uses this connection, so SQLite pragmas and PostgreSQL search_path apply.
            config.attributes["connection"] = connection
            getattr(command, command_name)(config, revision)

    @contextmanager
    def migration_connection(self) -> Iterator[Any]:
        """A connection in a transaction, prepared for running migrations on this database."""
        if not self.is_sqlite:
            with self.engine.begin() as connection:
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
                yield connection
            return
        with self.engine.execution_options(**{_WRITE_OPTION: True}).connect() as connection:
            # Batch migrations rebuild tables (create, copy, drop); with foreign keys on, the DROP
            # would cascade-delete child rows. The pragma only takes effect outside a transaction.
            raw = connection.connection.dbapi_connection
            assert raw is not None
            raw.execute("PRAGMA foreign_keys=OFF")
            try:
                with connection.begin():
                    yield connection
                problems = raw.execute("PRAGMA foreign_key_check").fetchall()
                if problems:
                    raise RuntimeError(f"foreign key violations after migration: {problems[:10]}")
            finally:
                raw.execute("PRAGMA foreign_keys=ON")

    def dispose(self) -> None:
        self.engine.dispose()


def open_existing(url: str) -> Database:
    """The database at ``url`` as it is, for a command that only reads (or changes only what is
    already there: `cancel`, `purge`): never created, never migrated. DatabaseNotReady names what
    is missing; the command line adds where the URL came from (worker.errors)."""
    db = Database(url, create=False)
    db.require_schema()
    return db


def _install_sqlite_hooks(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take BEGIN away from the sqlite3 module (it skips it before SELECTs and DDL), so that
        # transactions are real and we can choose BEGIN IMMEDIATE for writers.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            # WAL: readers never block the writer and vice versa.
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(_BUSY_TIMEOUT_PRAGMA)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        write = connection.get_execution_options().get(_WRITE_OPTION, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
