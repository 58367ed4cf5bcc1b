"""Migrations build exactly the models' schema, on SQLite and PostgreSQL, both ways."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from storage.db import Database, migrations_folder
from storage.models import include_object_for, schema_metadata

REPO = Path(__file__).resolve().parents[1]
TABLES = {"jobs", "sources", "units", "results", "drop_claims"}


def _tables(db: Database) -> set[str]:
    with db.engine.connect() as connection:
        return set(inspect(connection).get_table_names())


def _current_revision(db: Database) -> str | None:
    with db.engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def _drift(db: Database) -> list[object]:
    """What autogenerate would change. Model objects meant for another dialect are left out (the
    GIN index on results.output is PostgreSQL-only, so SQLite must not "lack" it), and views
    (result_rows) are never compared: the inspector lists tables only."""
    with db.engine.connect() as connection:
        opts = {"compare_type": True, "include_object": include_object_for(connection.dialect.name)}
        context = MigrationContext.configure(connection, opts=opts)
        return list(compare_metadata(context, schema_metadata()))


def _head() -> str:
    config = Database("sqlite://").alembic_config()
    return ScriptDirectory.from_config(config).get_current_head() or ""


def test_single_head_and_packaged_folder() -> None:
    folder = migrations_folder()
    assert (folder / "env.py").is_file()
    files = sorted(p.name for p in (folder / "versions").glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert files[0] == "0001_initial.py"
    # Numbered one after another, and the newest file is the single head.
    assert [name[:4] for name in files] == [f"{i:04d}" for i in range(1, len(files) + 1)]
    assert _head() == files[-1][:4]


def test_upgrade_creates_all_tables(db_url: str) -> None:
    db = Database(db_url)
    try:
        db.upgrade()
        assert _tables(db) >= TABLES
        assert _current_revision(db) == _head()
        db.upgrade()  # a second upgrade is a no-op
        assert _current_revision(db) == _head()
    finally:
        db.dispose()


def test_downgrade_to_base_and_up_again(db_url: str) -> None:
    db = Database(db_url)
    try:
        db.upgrade()
        db.downgrade("base")
        assert not (TABLES & _tables(db))
        assert _current_revision(db) is None
        db.upgrade()
        assert _tables(db) >= TABLES
        assert _drift(db) == []
    finally:
        db.dispose()


def test_no_drift_between_models_and_migrations(db: Database) -> None:
    """Autogenerate against the migrated database must find nothing to do."""
    assert _drift(db) == []


def test_drift_check_is_not_vacuous(db_url: str) -> None:
    """On an empty database the same comparison must see every table missing."""
    db = Database(db_url)
    try:
        added = {diff[1].name for diff in _drift(db) if isinstance(diff, tuple) and diff[0] == "add_table"}
        assert added == TABLES
    finally:
        db.dispose()


def test_upgrade_does_not_depend_on_cwd(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    db = Database(sqlite_url)
    try:
        db.upgrade()
        assert _tables(db) >= TABLES
    finally:
        db.dispose()


def test_alembic_cli_uses_repo_ini(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "VISBATCH_DATABASE_URL": url}
    alembic = Path(sys.executable).with_name("alembic")
    done = subprocess.run(
        [str(alembic), "upgrade", "head"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    db = Database(url)
    try:
        assert _current_revision(db) == _head()
        assert _drift(db) == []
    finally:
        db.dispose()


def test_masked_url_hides_password() -> None:
    db = Database("postgresql+psycopg://user:s3cret@127.0.0.1:1/nowhere")
    try:
        assert "s3cret" not in repr(db)
        assert "s3cret" not in db.masked_url
    finally:
        db.dispose()
