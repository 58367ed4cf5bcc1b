"""The database at scale (issue 24), at a small scale for correctness, on SQLite and PostgreSQL:
the token report close_job stores is what status counted live, the batched export keeps the
order, and migration 0007 goes up and down with the data kept."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import inspect, select, update

import storage.results
from storage import repository as repo
from storage.db import Database
from storage.jobs import closed_report
from storage.models import JOBS
from storage.repository import ResultRow, UnitRow
from storage.review import load_job

SPEC = {"prompts": ["describe", "extract"]}


def _result(unit_id: int, prompt: int, *, error: str | None = None) -> ResultRow:
    return ResultRow(
        unit_id, prompt, None if error else {"u": unit_id}, "text", error, 10 + prompt, 100, 5 + unit_id % 3,
        "stop", "m", "e", unit_id % 2 == 0, 1.0, pruned_tokens=prompt, merged_tokens=1,
    )  # fmt: skip


def finished_job(db: Database, uris: list[str], pages: int = 3) -> str:
    started = repo.start_job(db, SPEC, [(uri, None) for uri in uris])
    pairs, finished = [], []
    for source_id, _uri in started.sources:
        rows = [
            UnitRow(i, 64, 64, f"images/{source_id}-{i}.png", 50 + i, full_tokens=80) for i in range(pages)
        ]
        unit_ids = repo.add_units(db, started.job_id, source_id, rows)
        repo.complete_source(db, source_id, kind="pdf", sha256="a" * 64, size=10)
        repo.mark_units_encoded(db, [(u, f"key{u}", u % 2 == 0) for u in unit_ids])
        for u in unit_ids:
            for p in (0, 1):
                # One failed answer per source: the job ends partial (and can be resumed).
                failed = p == 1 and u == unit_ids[0]
                pairs.append((started.job_id, _result(u, p, error="bad" if failed else None)))
            finished.append((started.job_id, u))
    done = repo.store_results(db, pairs, finished)
    assert repo.close_finished(db, done.remaining)
    return started.job_id


def _live(db: Database, job_id: str) -> dict[str, Any]:
    """The summary as counted from the rows (the stored report set aside)."""
    with db.session() as session:
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(tokens=None))
    return repo.job_summary(db, job_id)


def test_a_finished_job_reads_what_close_job_counted(db: Database) -> None:
    job_id = finished_job(db, ["file:///b.pdf", "file:///a.pdf"])
    stored = repo.job_summary(db, job_id)
    with db.session(readonly=True) as session:
        assert closed_report(session.execute(select(JOBS).where(JOBS.c.id == job_id)).one()) is not None
    live = _live(db, job_id)
    assert stored["status"] == live["status"] == "partial"
    for key in ("results", "results_failed", "prompt_tokens", "completion_tokens", "tokens", "errors"):
        assert stored[key] == live[key], key
    assert stored["results"] + stored["results_failed"] == 12
    assert stored["tokens"]["saved"]["pruning"] == 6 and stored["tokens"]["saved"]["merging"] == 12
    assert load_job(db, job_id).tokens == live["tokens"]


def test_the_stored_report_goes_when_the_job_moves_again(db: Database) -> None:
    job_id = finished_job(db, ["file:///a.pdf"])

    def report() -> Any:
        with db.session(readonly=True) as session:
            return session.scalar(select(JOBS.c.tokens).where(JOBS.c.id == job_id))

    assert report() is not None
    repo.reopen_job(db, job_id)  # resume: the job runs again, status counts live
    assert report() is None
    repo.close_job(db, job_id)
    assert report() is not None
    repo.set_job_status(db, job_id, "cancelled", error="by hand")  # not recounted: counts live
    assert report() is None
    assert repo.job_summary(db, job_id)["results"] > 0


def test_the_export_streams_in_order_across_source_batches(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    uris = [f"file:///doc-{n}.pdf" for n in (7, 3, 11, 1, 5)]
    job_id = finished_job(db, uris, pages=2)
    monkeypatch.setattr(storage.results, "SOURCES_PER_QUERY", 2)  # 5 sources: 3 queries
    rows = list(repo.iter_results(db, job_id, chunk_size=3))
    keys = [(r["source"], r["unit"], r["prompt_index"]) for r in rows]
    assert keys == sorted(keys)
    assert len(keys) == 5 * 2 * 2
    assert {r["source"] for r in rows} == set(uris)


def _indexes(db: Database, table: str) -> set[str]:
    with db.engine.connect() as connection:
        return {index["name"] for index in inspect(connection).get_indexes(table)}


def _columns(db: Database, table: str) -> set[str]:
    with db.engine.connect() as connection:
        return {column["name"] for column in inspect(connection).get_columns(table)}


def test_migration_0007_up_and_down_keeps_the_data(db_url: str) -> None:
    db = Database(db_url)
    try:
        # The data written by today's code (its results have the columns of later revisions too),
        # then down past 0007 (every later revision's downgrade with rows in its tables) and up.
        db.upgrade()
        job_id = finished_job(db, ["file:///a.pdf"])
        assert "tokens" in _columns(db, "jobs")
        assert "ix_results_job_id_failed" in _indexes(db, "results")
        assert "ix_units_cache_key" in _indexes(db, "units")
        db.downgrade("0006")
        assert "tokens" not in _columns(db, "jobs")
        assert "ix_results_job_id_failed" not in _indexes(db, "results")
        assert "ix_units_cache_key" not in _indexes(db, "units")
        with db.engine.connect() as connection:
            assert connection.scalar(select(JOBS.c.id).where(JOBS.c.id == job_id)) == job_id
        db.upgrade()
        assert "ix_results_job_id_failed" in _indexes(db, "results")
        # A job closed before 0007 has no stored report: status counts it from the rows, as before.
        summary = repo.job_summary(db, job_id)
        assert summary["results"] + summary["results_failed"] == 6
        assert summary["tokens"]["spent"]["visual"] == 50 + 51 + 52
    finally:
        db.dispose()
