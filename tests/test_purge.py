"""`visbatch purge` (storage.retention): finished jobs go with their rows and the cached tokens no
other job uses, in batches; running jobs and other jobs' rows and entries stay. On SQLite and
PostgreSQL, with a folder cache, and with a real Redis in front of moto's S3."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select, update

from storage import repository as repo
from storage import retention
from storage.db import Database
from storage.models import JOBS, RESULTS, SOURCES, UNITS, utcnow
from storage.object_store import ObjectNotFound, S3ObjectStore
from storage.repository import ResultRow, UnitRow
from storage.token_cache import FolderTokenCache, RedisTokenCache, S3TokenCache, TieredTokenCache

SPEC = {"prompts": ["describe", "extract"]}
BIN = Path(sys.executable).parent


def _key(name: str) -> str:
    return f"k{name}".ljust(40, "0")


def _result(unit_id: int, prompt: int) -> ResultRow:
    return ResultRow(unit_id, prompt, {"a": unit_id}, "ok", None, 10, 100, 5, "stop", "m", "e", False, 1.0)


def finished_job(db: Database, keys: list[str], *, days_ago: float = 0, uri: str = "file:///a.pdf") -> str:
    """A succeeded job of one source, one unit per cache key, 2 answers each, finished `days_ago`."""
    started = repo.start_job(db, SPEC, [(uri, None)])
    job_id, ((source_id, _),) = started.job_id, started.sources
    rows = [UnitRow(i, 64, 64, f"images/{i}.png", 10) for i in range(len(keys))]
    unit_ids = repo.add_units(db, job_id, source_id, rows)
    repo.complete_source(db, source_id, kind="pdf", sha256="a" * 64, size=10)
    repo.mark_units_encoded(db, [(u, key, False) for u, key in zip(unit_ids, keys, strict=True)])
    done = repo.store_results(
        db, [(job_id, _result(u, p)) for u in unit_ids for p in (0, 1)], [(job_id, u) for u in unit_ids]
    )
    repo.close_finished(db, done.remaining)
    when = utcnow() - timedelta(days=days_ago)
    with db.session() as session:
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(created_at=when, finished_at=when))
    return job_id


def running_job(db: Database, keys: list[str], *, days_ago: float) -> str:
    started = repo.start_job(db, SPEC, [("file:///r.pdf", None)])
    job_id, ((source_id, _),) = started.job_id, started.sources
    unit_ids = repo.add_units(
        db, job_id, source_id, [UnitRow(i, 64, 64, f"images/r{i}.png", 10) for i in range(len(keys))]
    )
    repo.mark_units_encoded(db, [(u, key, False) for u, key in zip(unit_ids, keys, strict=True)])
    with db.session() as session:
        session.execute(
            update(JOBS).where(JOBS.c.id == job_id).values(created_at=utcnow() - timedelta(days=days_ago))
        )
    return job_id


def rows_of(db: Database, job_id: str) -> tuple[int, int, int, int]:
    with db.session(readonly=True) as session:

        def count(table: Any) -> int:
            return int(
                session.scalar(select(func.count()).select_from(table).where(table.c.job_id == job_id))
            )

        jobs = int(session.scalar(select(func.count()).where(JOBS.c.id == job_id)))
        return jobs, count(SOURCES), count(UNITS), count(RESULTS)


def test_purge_takes_old_finished_jobs_only(db: Database, tmp_path: Path) -> None:
    cache = FolderTokenCache(tmp_path / "cache", 10**9)
    shared, old_only, new_only, running_key = _key("shared"), _key("old"), _key("new"), _key("run")
    for key in (shared, old_only, new_only, running_key):
        cache.put(key, b"tokens")
    old = finished_job(db, [shared, old_only, old_only], days_ago=40, uri="file:///old.pdf")
    new = finished_job(db, [shared, new_only], days_ago=1, uri="file:///new.pdf")
    running = running_job(db, [running_key], days_ago=40)

    candidates = retention.find_purgeable(db, before=utcnow() - timedelta(days=30))
    assert [c.id for c in candidates] == [old]
    assert (candidates[0].sources, candidates[0].units, candidates[0].results) == (1, 3, 6)
    # The dry run's count: the old job names 2 entries, one of which the new job uses too.
    assert retention.orphaned_entries(db, [old]) == 1

    # Batches of 2 units: the job's 3 units take two transactions.
    done = retention.purge_jobs(db, [old], delete_entries=retention.cache_deleter(cache), batch=2)
    assert (done.jobs, done.sources, done.units, done.results, done.cache_entries) == (1, 1, 3, 6, 1)
    assert rows_of(db, old) == (0, 0, 0, 0)
    assert rows_of(db, new) == (1, 1, 2, 4)
    assert rows_of(db, running) == (1, 1, 1, 0)
    assert cache.get(old_only) is None
    assert cache.get(shared) == b"tokens"  # the new job still uses it
    assert cache.get(new_only) == b"tokens" and cache.get(running_key) == b"tokens"
    # What is left reads as before.
    assert repo.job_summary(db, new)["results"] == 4


def test_running_jobs_are_refused(db: Database) -> None:
    running = running_job(db, [_key("r")], days_ago=0)
    with pytest.raises(retention.JobRunning, match="cancel it first"):
        retention.find_purgeable(db, job=running[:8])
    with pytest.raises(retention.JobRunning):
        retention.purge_job(db, running)
    assert rows_of(db, running) == (1, 1, 1, 0)


def test_an_interrupted_purge_is_finished_by_running_it_again(db: Database, tmp_path: Path) -> None:
    cache = FolderTokenCache(tmp_path / "cache", 10**9)
    keys = [_key(str(i)) for i in range(5)]
    for key in keys:
        cache.put(key, b"t")
    job = finished_job(db, keys, days_ago=40)
    calls = []

    def failing(batch: list[str]) -> int:
        calls.append(batch)
        if len(calls) == 2:
            raise ConnectionError("the cache went away")
        return retention.cache_deleter(cache)(batch)

    with pytest.raises(ConnectionError):
        retention.purge_job(db, job, delete_entries=failing, batch=2)
    # The first batch went (its entries first, then its rows); the job is still there to purge.
    assert rows_of(db, job) == (1, 1, 3, 6)
    assert [c.id for c in retention.find_purgeable(db, before=utcnow() - timedelta(days=30))] == [job]
    done = retention.purge_job(db, job, delete_entries=retention.cache_deleter(cache), batch=2)
    assert (done.units, done.results, done.jobs) == (3, 6, 1)
    assert rows_of(db, job) == (0, 0, 0, 0)
    assert all(cache.get(key) is None for key in keys)


def test_purge_deletes_redis_and_s3_entries(
    sqlite_db: Database, redis_url: str, redis_prefix: str, s3_client: Any, s3_bucket: str
) -> None:
    """Hot (a real Redis) and cold (moto S3) entries of the purged job go, in batched requests;
    an entry another job uses stays in both tiers."""
    db = sqlite_db
    cold = S3ObjectStore(s3_bucket, "cache", client=s3_client)
    hot = RedisTokenCache.from_url(redis_url, namespace=redis_prefix)
    cache = TieredTokenCache(hot, S3TokenCache(cold))
    keys = [_key(f"p{i}") for i in range(7)]
    shared = _key("shared")
    for key in [*keys, shared]:
        cache.put(key, b"tokens")
    old = finished_job(db, [*keys, shared], days_ago=40, uri="file:///old.pdf")
    finished_job(db, [shared], days_ago=1, uri="file:///new.pdf")

    done = retention.purge_jobs(db, [old], delete_entries=retention.cache_deleter(cache), batch=3)
    assert done.cache_entries == len(keys)
    client = redis.Redis.from_url(redis_url)
    try:
        for key in keys:
            assert client.get(redis_prefix + key) is None
            with pytest.raises(ObjectNotFound):
                cold.get_bytes(S3TokenCache._key(key))
        assert client.get(redis_prefix + shared) == b"tokens"
    finally:
        client.close()
    assert cold.get_bytes(S3TokenCache._key(shared)) == b"tokens"


def _visbatch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "visbatch"), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_purge_command(sqlite_url: str, tmp_path: Path) -> None:
    """As a user runs it: --dry-run deletes nothing, --older-than deletes the old finished job,
    --job refuses a running one (exit 2, with the way out)."""
    db = Database(sqlite_url)
    db.upgrade()
    home = tmp_path / "home"
    cache = FolderTokenCache(home / "token-cache", 10**9)
    cache.put(_key("old"), b"t")
    old = finished_job(db, [_key("old")], days_ago=40)
    new = finished_job(db, [_key("new")], days_ago=1, uri="file:///new.pdf")
    running = running_job(db, [_key("run")], days_ago=40)
    env = {**os.environ, "VISBATCH_DATABASE_URL": sqlite_url, "VISBATCH_HOME": str(home)}
    env.pop("VISBATCH_CACHE_URL", None)

    dry = _visbatch(env, "purge", "--older-than", "30d", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert old[:12] in dry.stdout and new[:12] not in dry.stdout and running[:12] not in dry.stdout
    assert "would delete 1 job(s): 1 sources, 1 pages/frames, 2 answers" in dry.stderr
    assert "cached token entries no other job uses: 1" in dry.stderr
    assert rows_of(db, old) == (1, 1, 1, 2)

    refused = _visbatch(env, "purge", "--job", running[:12])
    assert refused.returncode == 2 and "running" in refused.stderr and "visbatch cancel" in refused.stderr

    bad = _visbatch(env, "purge", "--older-than", "30 days")
    assert bad.returncode == 2 and "not an age" in bad.stderr

    done = _visbatch(env, "purge", "--older-than", "30d")
    assert done.returncode == 0, done.stderr
    assert "deleted 1 job(s): 1 sources, 1 pages/frames, 2 answers, 1 cached token entries" in done.stderr
    assert rows_of(db, old) == (0, 0, 0, 0) and rows_of(db, new)[0] == 1 and rows_of(db, running)[0] == 1
    assert cache.get(_key("old")) is None
    db.dispose()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", timedelta(days=30)),
        ("12h", timedelta(hours=12)),
        ("2w", timedelta(weeks=2)),
        ("90m", timedelta(minutes=90)),
    ],
)
def test_ages(text: str, expected: timedelta) -> None:
    from worker.cli.purge import parse_age

    assert parse_age(text) == expected


def retention_sql() -> list[str]:
    """docs/sql.md's statements under a `-- Retention:` comment, in order."""
    import re

    body = (Path(__file__).resolve().parents[1] / "docs" / "sql.md").read_text()
    statements = []
    for block in re.findall(r"```sql\n(.*?)```", body, flags=re.S):
        if "-- Retention:" not in block:
            continue
        for statement in block.split(";"):
            code = "\n".join(line for line in statement.splitlines() if not line.startswith("--")).strip()
            if code:
                statements.append(code)
    return statements


def test_the_documented_retention_sql(db: Database) -> None:
    """docs/sql.md's retention SQL as written (the job id and cut-off filled in), each DELETE
    repeated until it deletes nothing: the old job is gone, the other one intact."""
    from sqlalchemy import text

    old = finished_job(db, [_key("shared"), _key("only")], days_ago=40, uri="file:///old.pdf")
    new = finished_job(db, [_key("shared")], days_ago=1, uri="file:///new.pdf")
    cutoff = (utcnow() - timedelta(days=30)).strftime("%Y-%m-%d")
    listing, keys, *deletes = retention_sql()
    assert len(deletes) == 4 and all(d.startswith("DELETE") for d in deletes)

    def bound(sql: str) -> Any:
        # The docs' SQL, the job id and cut-off bound where the page writes '...' and a date.
        return text(sql.replace("'...'", ":job").replace("'2026-11-01'", ":cutoff"))

    with db.engine.begin() as connection:
        found = connection.execute(bound(listing), {"cutoff": cutoff}).all()
        assert [row[0] for row in found] == [old]
        only = connection.execute(bound(keys), {"job": old}).all()
        assert [row[0] for row in only] == [_key("only")]
    for statement in deletes:
        while True:
            with db.engine.begin() as connection:
                if connection.execute(bound(statement), {"job": old}).rowcount == 0:
                    break
    assert rows_of(db, old) == (0, 0, 0, 0)
    assert rows_of(db, new) == (1, 1, 1, 2)
