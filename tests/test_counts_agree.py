"""Counts that agree (issue 31, item 6), on SQLite and PostgreSQL, without a model: `jobs` shows
the answers `status` shows for a job close_job never counted (running, cancelled by a second
Ctrl-C, interrupted); a resumed job's rate is this run's, not one over the hours it sat stopped;
a stopped job's summary says what was encoded, what its busy times sum, and how many pages
answered per second."""

from __future__ import annotations

import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import update

from storage import repository as repo
from storage.db import Database
from storage.leases import end_held, read_lease, take_lease
from storage.models import JOBS, RESULTS, utcnow
from storage.repository import ResultRow, UnitRow
from worker.cli.output import print_summary

SPEC = {"prompts": ["describe", "extract"]}
PAGES = 6


def _result(unit_id: int, prompt: int, error: str | None = None) -> ResultRow:
    output = None if error else {"u": unit_id}
    return ResultRow(unit_id, prompt, output, "text", error, 10, 100, 5, "stop", "m", "e", False, 1.0)


def _job(db: Database) -> tuple[str, list[int]]:
    """A running job of one PDF: 6 pages stored (100 visual tokens each), none encoded."""
    started = repo.start_job(db, SPEC, [("file:///a.pdf", None)])
    [(source_id, _uri)] = started.sources
    rows = [UnitRow(i, 64, 64, f"images/{i}.png", 100) for i in range(PAGES)]
    unit_ids = repo.add_units(db, started.job_id, source_id, rows)
    repo.complete_source(db, source_id, kind="pdf", sha256="a" * 64, size=10)
    return started.job_id, unit_ids


def _answer(db: Database, job_id: str, unit_ids: list[int], *, failed: int | None = None) -> None:
    """Encode and answer these units (every prompt; one failed answer on unit `failed`)."""
    repo.mark_units_encoded(db, [(u, f"key{u}", False) for u in unit_ids])
    pairs = [
        (job_id, _result(u, p, "bad" if (u, p) == (failed, 1) else None)) for u in unit_ids for p in (0, 1)
    ]
    repo.store_results(db, pairs, [(job_id, u) for u in unit_ids])


def _listed(db: Database, job_id: str) -> dict[str, Any]:
    [item] = [item for item in repo.list_jobs(db) if item["id"] == job_id]
    return item


def _agree(db: Database, job_id: str) -> tuple[int, int]:
    """(answers, failed) as `jobs` shows them, checked against what `status` shows."""
    item, summary = _listed(db, job_id), repo.job_summary(db, job_id)
    shown = (item["results_total"] - item["results_failed"], item["results_failed"])
    assert shown == (summary["results"], summary["results_failed"]), summary["status"]
    return shown


def _take(db: Database, job_id: str) -> str:
    holder = uuid.uuid4().hex
    assert take_lease(db, read_lease(db, job_id), holder, "host:1:2:ns", lease_s=30)
    return holder


def test_jobs_counts_answers_as_status_does_whatever_ended_the_job(db: Database) -> None:
    job_id, unit_ids = _job(db)
    holder = _take(db, job_id)
    _answer(db, job_id, unit_ids[:1])
    assert _agree(db, job_id) == (2, 0)  # running (or interrupted: the same row, its lease expired)

    # A second Ctrl-C: the run ends its job cancelled while it holds it (close_job never runs).
    assert end_held(db, job_id, holder, "cancelled", "interrupted by a second SIGINT")
    assert _agree(db, job_id) == (2, 0)

    # Resumed, one more page answered (one answer failed), then cancelled from elsewhere.
    repo.reopen_job(db, job_id)
    _answer(db, job_id, unit_ids[1:2], failed=unit_ids[1])
    repo.set_job_status(db, job_id, "cancelled", error="cancelled by the user")
    assert _agree(db, job_id) == (3, 1)

    # Closed: the row's own count (close_job's), still the same.
    repo.close_job(db, job_id)
    assert _agree(db, job_id) == (3, 1)


def test_jobs_counts_only_the_listed_jobs_without_a_count(db: Database) -> None:
    jobs = []
    for answered in (1, 2, 0):
        job_id, unit_ids = _job(db)
        _answer(db, job_id, unit_ids[:answered])
        jobs.append(job_id)
    repo.set_job_status(db, jobs[0], "cancelled")
    for job_id, answered in zip(jobs, (1, 2, 0), strict=True):
        assert _agree(db, job_id) == (2 * answered, 0)
    # The row's count is read as is once close_job wrote one (status reads it too, not the rows).
    with db.session() as session:
        session.execute(update(JOBS).where(JOBS.c.id == jobs[1]).values(status="partial", tokens={}))
        session.execute(update(JOBS).where(JOBS.c.id == jobs[1]).values(results_total=99))
    assert _listed(db, jobs[1])["results_total"] == 99


def test_a_resumed_jobs_rate_is_measured_from_the_resume(db: Database) -> None:
    job_id, unit_ids = _job(db)
    _answer(db, job_id, unit_ids[:2])
    repo.set_job_status(db, job_id, "cancelled")
    hours_ago = utcnow() - timedelta(hours=3)
    with db.session() as session:  # the first run: three hours ago
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(started_at=hours_ago))
        session.execute(update(RESULTS).where(RESULTS.c.job_id == job_id).values(updated_at=hours_ago))
    repo.reopen_job(db, job_id)
    with db.session() as session:  # resumed a minute ago
        resumed = utcnow() - timedelta(seconds=60)
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(resumed_at=resumed))
    _answer(db, job_id, unit_ids[2:5])  # three pages in this run's minute

    timing = repo.job_summary(db, job_id)["timing"]
    assert timing["rate_units_per_second"] == pytest.approx(3 / 60, rel=0.05)
    assert timing["eta_seconds"] == pytest.approx(1 / (3 / 60), rel=0.05)  # one page left
    assert timing["since_resume_seconds"] == pytest.approx(60, abs=5)
    assert timing["wall_seconds"] > 3 * 3600
    # Over the whole wall time it would count the hours stopped: a resumed job has no such rate.
    assert timing["answered_units_per_second"] is None
    text = _printed(repo.job_summary(db, job_id))
    assert "0.05 pages+frames answered/s since the resume, about 20 s at that rate" in text


def test_a_resume_does_not_move_the_stall_watchs_later_claim_back(db: Database) -> None:
    job_id, _ = _job(db)
    repo.set_job_status(db, job_id, "cancelled")
    later = utcnow() + timedelta(minutes=3)
    with db.session() as session:  # a sweep's own `now` (tests/test_stall_watch.py sweeps ahead)
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(resumed_at=later))
    repo.reopen_job(db, job_id)
    assert repo.job_summary(db, job_id)["resumed_at"] == later.isoformat()


def _printed(summary: dict[str, Any]) -> str:
    out = StringIO()
    print_summary(Console(file=out, width=400, soft_wrap=True), summary)
    return out.getvalue()


def test_a_stopped_jobs_summary_says_what_was_encoded_and_answered(db: Database) -> None:
    job_id, unit_ids = _job(db)
    repo.mark_units_encoded(db, [(u, f"key{u}", False) for u in unit_ids[:2]])  # 2 of 6 encoded
    for stage, seconds in (("encode", 24.3), ("ingest", 3.0)):
        repo.add_stage_seconds(db, job_id, stage, seconds)
    repo.set_job_status(db, job_id, "cancelled", error="interrupted by SIGINT")

    summary = repo.job_summary(db, job_id)
    tokens = summary["tokens"]
    assert tokens["spent"]["visual"] == 2 * 100
    assert (tokens["units_not_encoded"], tokens["visual_not_encoded"]) == (4, 4 * 100)
    assert summary["timing"]["answered_units_per_second"] == 0  # no answer: none per second
    text = _printed(summary)
    assert "visual 200 for the pages+frames encoded" in text
    assert "400 more planned for the 4 not encoded yet" in text
    assert "0.00 pages+frames answered/s" in text and "pages+frames/s" not in text
    assert "encode 24.3 s, generate 0.0 s (summed over threads and processes)" in text


def test_a_finished_jobs_rate_counts_answered_pages(db: Database) -> None:
    job_id, unit_ids = _job(db)
    with db.session() as session:
        started = utcnow() - timedelta(seconds=10)
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(started_at=started))
    _answer(db, job_id, unit_ids[:3])
    repo.set_job_status(db, job_id, "cancelled")
    timing = repo.job_summary(db, job_id)["timing"]
    assert timing["answered_units_per_second"] == pytest.approx(3 / 10, rel=0.05)  # not 6 stored
