"""Database fixtures: a SQLite file and a PostgreSQL schema per test, both migrated to head.

PostgreSQL comes from ``VISBATCH_TEST_POSTGRES_URL`` (default: the local trust-auth server).
When it cannot be reached the PostgreSQL cases are skipped, except under ``CI=true`` where a
missing server is a failure: CI must never go green by silently testing SQLite only.

Fixtures:
  ``sqlite_url`` / ``postgres_url``  an empty database (a fresh file / a fresh schema), as a URL
  ``sqlite_db`` / ``postgres_db``    a ``Database`` on it, upgraded to head
  ``db_url`` / ``db``                the same, parametrized over both backends
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from storage.db import Database, mask_url

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _postgres_base_url() -> str:
    return os.environ.get("VISBATCH_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)


@cache
def _postgres_unreachable_reason() -> str | None:
    """None when the server answers, else why not (checked once per session)."""
    url = make_url(_postgres_base_url()).update_query_dict({"connect_timeout": "3"})
    engine = create_engine(url, pool_pre_ping=False)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:  # any driver or network error means "not available here"
        return f"PostgreSQL at {mask_url(url)} is not reachable: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        engine.dispose()
    return None


def _require_postgres() -> None:
    reason = _postgres_unreachable_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: PostgreSQL tests must run, not skip)", pytrace=False)
    pytest.skip(f"{reason}; set VISBATCH_TEST_POSTGRES_URL to run the PostgreSQL tests")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'db' / 'visbatch.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A URL whose connections see only a fresh, empty schema (via search_path), dropped afterwards."""
    _require_postgres()
    base = make_url(_postgres_base_url())
    schema = f"test_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base)
    try:
        with admin.begin() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        url = base.update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        admin.dispose()


@pytest.fixture
def sqlite_db(sqlite_url: str) -> Iterator[Database]:
    db = Database(sqlite_url)
    db.upgrade()
    yield db
    db.dispose()


@pytest.fixture
def postgres_db(postgres_url: str) -> Iterator[Database]:
    db = Database(postgres_url)
    db.upgrade()
    yield db
    db.dispose()


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest) -> Database:
    return request.getfixturevalue(f"{request.param}_db")
