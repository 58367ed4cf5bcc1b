"""`visbatch purge` (storage.retention): finished jobs go with their rows and the cached tokens no
other job uses, in batches; running jobs and other jobs' rows and entries stay. On SQLite and
PostgreSQL, with a folder cache, and with a real Redis in front of moto's S3."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence
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
    repeated until it deletes nothing: the old job is gone, the other one intact. The entries
    listed are those purge deletes: not one another job names, nor one a running job will use
    (a pending page of the same pixels, a file not split yet)."""
    from sqlalchemy import text

    old = finished_files(db, {"file:///old.pdf": ["shared", "only", "soon"], "file:///more.pdf": ["more"]})
    new = finished_files(db, {"file:///new.pdf": ["shared"]}, days_ago=1)
    live_job(db, pending=["soon"], unsplit={"file:///more.pdf": None})
    assert retention.orphaned_entries(db, [old]) == 1
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


# --- What a live job uses or will use stays (issue 32, item 4) -------------------------------


def _image(name: str) -> str:
    """A page's image key as ingest stores it (images/<h[:2]>/<h>.png): its content."""
    digest = hashlib.sha256(name.encode()).hexdigest()
    return f"images/{digest[:2]}/{digest}.png"


def _sha(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()


def finished_files(db: Database, files: dict[str, list[str]], *, days_ago: float = 40) -> str:
    """A succeeded job, one source per uri (its sha256 from the uri), one unit per page name: the
    page's pixels `_image(name)`, its entry `_key(name)`."""
    started = repo.start_job(db, SPEC, [(uri, None) for uri in files])
    unit_ids = []
    for source_id, uri in started.sources:
        pages = files[uri]
        rows = [UnitRow(i, 64, 64, _image(name), 10) for i, name in enumerate(pages)]
        ids = repo.add_units(db, started.job_id, source_id, rows, sha256=_sha(uri))
        repo.complete_source(db, source_id, kind="pdf", sha256=_sha(uri), size=10)
        repo.mark_units_encoded(db, [(u, _key(name), False) for u, name in zip(ids, pages, strict=True)])
        unit_ids += ids
    done = repo.store_results(
        db,
        [(started.job_id, _result(u, p)) for u in unit_ids for p in (0, 1)],
        [(started.job_id, u) for u in unit_ids],
    )
    repo.close_finished(db, done.remaining)
    when = utcnow() - timedelta(days=days_ago)
    with db.session() as session:
        session.execute(
            update(JOBS).where(JOBS.c.id == started.job_id).values(created_at=when, finished_at=when)
        )
    return started.job_id


def live_job(
    db: Database,
    *,
    encoded: Sequence[str] = (),
    pending: Sequence[str] = (),
    unsplit: dict[str, str | None] | None = None,
    status: str = "running",
) -> str:
    """A job still at work: one split source whose pages `encoded` name their entries and whose
    pages `pending` (not encoded yet) have only their pixels, and sources not split yet
    (`unsplit`: uri -> its sha256 once the first pages pinned it, None before the file is opened)."""
    uris = ["file:///live.pdf", *(unsplit or {})]
    started = repo.start_job(db, SPEC, [(uri, None) for uri in uris])
    (split_id, _), *others = started.sources
    names = [*encoded, *pending]
    rows = [UnitRow(i, 64, 64, _image(name), 10) for i, name in enumerate(names)]
    ids = repo.add_units(db, started.job_id, split_id, rows, sha256=_sha("file:///live.pdf"))
    repo.mark_units_encoded(
        db, [(u, _key(name), False) for u, name in zip(ids[: len(encoded)], encoded, strict=True)]
    )
    with db.session() as session:
        for source_id, uri in others:
            sha = (unsplit or {})[uri]
            session.execute(update(SOURCES).where(SOURCES.c.id == source_id).values(sha256=sha))
        session.execute(update(JOBS).where(JOBS.c.id == started.job_id).values(status=status))
    return started.job_id


def _entries(kept: retention.Purged) -> tuple[int, int, int, dict[str, int]]:
    return kept.cache_entries, kept.entries_kept_live, kept.entries_kept_shared, kept.kept_for


def test_a_running_job_keeps_the_entries_it_will_use(db: Database, tmp_path: Path) -> None:
    """The issue's case: a finished job of 23 pages, 18 of them shared with a running job that has
    encoded 6 (its units name the entries), has 9 still pending (no cache key yet: their pixels
    tell) and 3 in a file it has not split yet (the same uri). The 18 stay, the dry run says so
    and why, and of the 5 others the one a finished job that stays names stays too."""
    cache = FolderTokenCache(tmp_path / "cache", 10**9)
    report = [f"r{i:02}" for i in range(20)]  # _key pads with 0: "r1" would be "r10"
    annex = ["x0", "x1", "x2"]
    for name in [*report, *annex, "own"]:
        cache.put(_key(name), b"tokens")
    old = finished_files(db, {"file:///report.pdf": report, "file:///annex.pdf": annex})
    newer = finished_files(db, {"file:///other.pdf": ["r19"]}, days_ago=1)
    running = live_job(
        db, encoded=[*report[:6], "own"], pending=report[6:15], unsplit={"file:///annex.pdf": None}
    )
    assert [c.id for c in retention.find_purgeable(db, before=utcnow() - timedelta(days=30))] == [old]

    preview = retention.preview_entries(db, [old], batch=4)
    assert _entries(preview) == (4, 18, 1, {running: 18})
    assert preview.live_status == {running: "running"}
    assert retention.orphaned_entries(db, [old]) == 4

    done = retention.purge_jobs(db, [old], delete_entries=retention.cache_deleter(cache), batch=4)
    assert _entries(done) == _entries(preview)
    assert rows_of(db, old) == (0, 0, 0, 0) and rows_of(db, running)[2] == 16
    kept = [*report[:15], "r19", *annex, "own"]
    assert [name for name in [*report, *annex, "own"] if cache.get(_key(name)) is not None] == kept
    assert rows_of(db, newer) == (1, 1, 1, 2)

    # Once the running job has finished, purging it deletes the entries it named.
    with db.session() as session:
        session.execute(update(JOBS).where(JOBS.c.id == running).values(status="succeeded"))
    gone = retention.purge_jobs(db, [running], delete_entries=retention.cache_deleter(cache))
    assert gone.cache_entries == 7 and gone.entries_kept_live == 0
    assert cache.get(_key("r00")) is None and cache.get(_key("own")) is None


def test_files_not_split_yet_keep_their_entries(db: Database, tmp_path: Path) -> None:
    """A live job's source not split yet: the same file by its sha256 once pinned (another name,
    pages still to come), by its uri before the file is opened; a pinned sha256 that differs, or
    a source already split, keeps nothing. Queued jobs count as live; each live job is named
    with what it needs, an entry two of them need counted once."""
    cache = FolderTokenCache(tmp_path / "cache", 10**9)
    files = {
        "file:///a.pdf": ["a0", "a1", "a2"],
        "file:///b.pdf": ["b0", "b1"],
        "file:///c.pdf": ["c0", "c1"],
    }
    for pages in files.values():
        for name in pages:
            cache.put(_key(name), b"t")
    old = finished_files(db, files)
    by_uri = live_job(db, unsplit={"file:///a.pdf": None}, status="queued")
    by_sha = live_job(db, unsplit={"file:///copy-of-b.pdf": _sha("file:///b.pdf")}, pending=["a0"])
    changed = live_job(db, unsplit={"file:///c.pdf": _sha("another file")})
    split = live_job(db, encoded=["x"])  # its own file, split: nothing of the old job's
    with db.session() as session:  # and a split c.pdf whose pages are all encoded, other ones
        session.execute(
            update(SOURCES)
            .where(SOURCES.c.job_id == split, SOURCES.c.uri == "file:///live.pdf")
            .values(uri="file:///c.pdf", status="ingested")
        )

    preview = retention.preview_entries(db, [old])
    assert _entries(preview) == (2, 5, 0, {by_uri: 3, by_sha: 3})
    assert preview.live_status == {by_uri: "queued", by_sha: "running"}
    done = retention.purge_jobs(db, [old], delete_entries=retention.cache_deleter(cache))
    assert _entries(done) == _entries(preview)
    assert [n for p in files.values() for n in p if cache.get(_key(n))] == ["a0", "a1", "a2", "b0", "b1"]
    assert rows_of(db, changed)[0] == 1


def test_jobs_purged_together_count_a_shared_entry_once(db: Database, tmp_path: Path) -> None:
    """Two finished jobs purged in one go, sharing pages with each other and a running one: the
    dry run's counts are the purge's, each entry counted once, by the last job that names it."""
    cache = FolderTokenCache(tmp_path / "cache", 10**9)
    for name in ("s", "t", "u", "v", "w"):
        cache.put(_key(name), b"t")
    first = finished_files(db, {"file:///1.pdf": ["s", "t", "u"]}, days_ago=50)
    second = finished_files(db, {"file:///2.pdf": ["s", "t", "v"]}, days_ago=40)
    running = live_job(db, pending=["s"], encoded=["w"])
    ids = [c.id for c in retention.find_purgeable(db, before=utcnow() - timedelta(days=30))]
    assert ids == [first, second]

    preview = retention.preview_entries(db, ids, batch=2)
    assert _entries(preview) == (3, 1, 0, {running: 1})
    done = retention.purge_jobs(db, ids, delete_entries=retention.cache_deleter(cache), batch=2)
    assert _entries(done) == _entries(preview)
    assert [name for name in "stuvw" if cache.get(_key(name))] == ["s", "w"]


def test_a_live_job_s_entries_stay_in_redis_and_s3(
    sqlite_db: Database, redis_url: str, redis_prefix: str, s3_client: Any, s3_bucket: str
) -> None:
    """The hot (a real Redis) and cold (moto S3) tiers: the entry a running job's pending page
    will use stays in both, the purged job's other entries go from both."""
    db = sqlite_db
    cold = S3ObjectStore(s3_bucket, "cache", client=s3_client)
    hot = RedisTokenCache.from_url(redis_url, namespace=redis_prefix)
    cache = TieredTokenCache(hot, S3TokenCache(cold))
    names = ["p0", "p1", "p2"]
    for name in names:
        cache.put(_key(name), b"tokens")
    old = finished_files(db, {"file:///old.pdf": names})
    live_job(db, pending=["p1"])

    done = retention.purge_jobs(db, [old], delete_entries=retention.cache_deleter(cache))
    assert (done.cache_entries, done.entries_kept_live) == (2, 1)
    client = redis.Redis.from_url(redis_url)
    try:
        assert [name for name in names if client.get(redis_prefix + _key(name))] == ["p1"]
    finally:
        client.close()
    for name in ("p0", "p2"):
        with pytest.raises(ObjectNotFound):
            cold.get_bytes(S3TokenCache._key(_key(name)))
    assert cold.get_bytes(S3TokenCache._key(_key("p1"))) == b"tokens"


def test_the_purge_command_says_what_it_kept_for_a_running_job(sqlite_url: str, tmp_path: Path) -> None:
    """As a user runs it beside a running job: the dry run and the purge name the running job and
    how many entries they keep for it; the entries stay in the folder cache."""
    db = Database(sqlite_url)
    db.upgrade()
    home = tmp_path / "home"
    cache = FolderTokenCache(home / "token-cache", 10**9)
    pages = [f"p{i}" for i in range(5)]
    for name in pages:
        cache.put(_key(name), b"t")
    old = finished_files(db, {"file:///old.pdf": pages})
    running = live_job(db, encoded=pages[:1], pending=pages[1:3])
    env = {**os.environ, "VISBATCH_DATABASE_URL": sqlite_url, "VISBATCH_HOME": str(home)}
    env.pop("VISBATCH_CACHE_URL", None)
    said = f"kept 3 cached token entries that running job {running[:12]} uses or will use"

    dry = _visbatch(env, "purge", "--older-than", "30d", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "cached token entries no other job uses: 2" in dry.stderr
    assert said in dry.stderr and "(dry run: nothing deleted)" in dry.stderr
    assert rows_of(db, old)[0] == 1

    done = _visbatch(env, "purge", "--job", old[:12])
    assert done.returncode == 0, done.stderr
    assert "2 cached token entries" in done.stderr and said in done.stderr
    assert [name for name in pages if cache.get(_key(name))] == pages[:3]
    db.dispose()
