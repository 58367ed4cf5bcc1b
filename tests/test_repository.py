"""storage.repository on SQLite and PostgreSQL: state changes, counters, idempotence, fan-in."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import Connection, Row, Table, delete, event, func, select, update

import storage.jobs
from storage import repository as repo
from storage.db import Database
from storage.models import JOBS, RESULTS, SOURCES, UNITS, UnitStatus
from storage.repository import JobNotFound, ResultRow, SourceNotFound, UnitRow

SPEC = {"prompts": ["describe", "extract"], "json_schema": None, "sampling": {"max_new_tokens": 8}}


def by_id(session: Connection, table: Table, row_id: Any) -> Row[Any]:
    row = session.execute(select(table).where(table.c.id == row_id)).one_or_none()
    assert row is not None, f"no {table.name} row {row_id}"
    return row


def counters(db: Database, job_id: str) -> dict[str, Any]:
    with db.session(readonly=True) as session:
        return dict(by_id(session, JOBS, job_id)._mapping)


def count_rows(db: Database, table: Table, job_id: str) -> int:
    with db.session(readonly=True) as session:
        stmt = select(func.count()).select_from(table).where(table.c.job_id == job_id)
        return int(session.scalar(stmt) or 0)


def unit_rows(n: int, *, tokens: int = 100, start: int = 0) -> list[UnitRow]:
    return [UnitRow(i, 640, 480, f"img/{i}.png", tokens, timestamp=float(i)) for i in range(start, start + n)]


def result(unit_id: int, prompt: int = 0, *, error: str | None = None, text: str = "ok") -> ResultRow:
    return ResultRow(
        unit_id=unit_id,
        prompt_index=prompt,
        output=None if error else {"answer": text, "unit": unit_id},
        text=None if error else text,
        error=error,
        prompt_tokens=10,
        visual_tokens=100,
        completion_tokens=5,
        finish_reason="stop",
        model="tiny-qwen",
        engine="transformers",
        cache_hit=False,
        latency_ms=12.5,
    )


def job_with_units(db: Database, n: int = 3, uri: str = "file:///docs/a.pdf") -> tuple[str, int, list[int]]:
    """A job with one source split into `n` units and completed (its hold released)."""
    job_id = repo.create_job(db, SPEC)
    source_id = repo.add_source(db, job_id, uri)
    unit_ids = repo.add_units(db, job_id, source_id, unit_rows(n))
    repo.complete_source(db, source_id, kind="pdf", sha256="a" * 64, size=1234)
    return job_id, source_id, unit_ids


def run_to_end(db: Database, job_id: str, unit_ids: list[int], prompts: int = 1) -> None:
    repo.mark_units_encoded(db, [(unit_id, f"key-{unit_id}", False) for unit_id in unit_ids])
    repo.upsert_results(db, job_id, [result(u, p) for u in unit_ids for p in range(prompts)])
    repo.finish_units(db, unit_ids)


# --- jobs ----------------------------------------------------------------------------------------


def test_create_job_stores_spec_and_defaults(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    assert len(job_id) == 32
    job = counters(db, job_id)
    assert job["status"] == "queued"
    assert job["spec"] == SPEC
    assert job["finished_at"] is None
    assert job["created_at"].tzinfo is not None
    assert job["units_pending"] == 0 and job["visual_tokens"] == 0


def test_create_job_accepts_pydantic_spec(db: Database) -> None:
    from ingest.spec import JobSpec

    job_id = repo.create_job(db, JobSpec(prompts=["hello"]), status="running")
    job = counters(db, job_id)
    assert job["status"] == "running"
    assert job["spec"]["prompts"] == ["hello"]
    assert job["spec"]["sampling"]["max_new_tokens"] == 256


def test_set_job_status(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    repo.set_job_status(db, job_id, "running")
    assert counters(db, job_id)["finished_at"] is None
    repo.set_job_status(db, job_id, "failed", error="boom")
    job = counters(db, job_id)
    assert (job["status"], job["error"]) == ("failed", "boom")
    stamped = job["finished_at"]
    assert stamped is not None
    repo.set_job_status(db, job_id, "cancelled")
    assert counters(db, job_id)["finished_at"] == stamped  # stamped once
    with pytest.raises(ValueError):
        repo.set_job_status(db, job_id, "exploded")
    with pytest.raises(JobNotFound):
        repo.set_job_status(db, "0" * 32, "running")


# --- sources -------------------------------------------------------------------------------------


def test_add_source_is_idempotent(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    first = repo.add_source(db, job_id, "s3://bucket/a.pdf")
    assert repo.add_source(db, job_id, "s3://bucket/a.pdf") == first
    other = repo.add_source(db, job_id, "s3://bucket/b.mp4")
    assert other != first
    assert counters(db, job_id)["sources_total"] == 2
    assert count_rows(db, SOURCES, job_id) == 2
    # The same uri in another job is another source.
    second_job = repo.create_job(db, SPEC)
    assert repo.add_source(db, second_job, "s3://bucket/a.pdf") != first
    with pytest.raises(JobNotFound):
        repo.add_source(db, "f" * 32, "s3://bucket/a.pdf")


def test_sources_hold_the_countdown_until_complete(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    a = repo.add_source(db, job_id, "file:///a.pdf")
    repo.add_source(db, job_id, "file:///a.pdf")  # the same uri again: no second hold
    b = repo.add_source(db, job_id, "file:///b.pdf")
    assert counters(db, job_id)["units_pending"] == 2
    ids = repo.add_units(db, job_id, a, unit_rows(2))
    assert repo.complete_source(db, a, kind="pdf", sha256="a" * 64, size=9) == {job_id: 3}
    assert repo.complete_source(db, a) == {}  # a redelivered task: counts once
    assert repo.finish_units(db, ids) == {job_id: 1}  # b still holds the job open
    assert repo.complete_source(db, b, error="not a PDF") == {job_id: 0}
    job = counters(db, job_id)
    assert (job["sources_failed"], job["units_pending"]) == (1, 0)


def test_complete_source_with_error_counts_once(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    source_id = repo.add_source(db, job_id, "file:///broken.pdf")
    assert repo.complete_source(db, source_id, error="not a PDF", kind="pdf", size=3) == {job_id: 0}
    assert repo.complete_source(db, source_id, error="still not a PDF") == {}
    assert counters(db, job_id)["sources_failed"] == 1
    with db.session(readonly=True) as session:
        source = by_id(session, SOURCES, source_id)
        assert (source.status, source.error, source.kind, source.bytes) == ("failed", "not a PDF", "pdf", 3)
    with pytest.raises(SourceNotFound):
        repo.complete_source(db, 10**9, error="nope")
    other = repo.add_source(db, job_id, "file:///c.pdf")
    with pytest.raises(ValueError):
        repo.complete_source(db, other, kind="spreadsheet", sha256="c" * 64, size=1)


def test_start_job_creates_sources_and_holds_in_one_go(db: Database) -> None:
    started = repo.start_job(
        db, SPEC, [("file:///a.pdf", None), ("file:///gone.pdf", "file not found"), ("file:///a.pdf", None)]
    )
    job = counters(db, started.job_id)
    assert (job["status"], job["sources_total"], job["sources_failed"], job["units_pending"]) == (
        "running",
        2,
        1,
        1,
    )
    assert [uri for _, uri in started.sources] == ["file:///a.pdf"]
    assert job["started_at"] is not None
    empty = repo.start_job(db, SPEC, [])
    summary = repo.job_summary(db, empty.job_id)
    assert (summary["status"], summary["error"]) == ("failed", "no input files found")


# --- units ---------------------------------------------------------------------------------------


def test_add_units_twice_is_idempotent(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    source_id = repo.add_source(db, job_id, "file:///v.mp4")
    rows = [*unit_rows(3), UnitRow(3, None, None, None, None, timestamp=3.0, error="decode error")]
    ids = repo.add_units(db, job_id, source_id, rows)
    after_first = counters(db, job_id)
    # 3 pending units, plus the hold of the source (its ingest has not completed).
    assert (after_first["units_total"], after_first["units_failed"], after_first["units_pending"]) == (
        4,
        1,
        4,
    )
    assert after_first["visual_tokens"] == 300

    assert repo.add_units(db, job_id, source_id, rows) == ids
    assert counters(db, job_id) | {"updated_at": None} == after_first | {"updated_at": None}
    assert count_rows(db, UNITS, job_id) == 4

    # Ids come back in the order of the rows, not of the table.
    assert repo.add_units(db, job_id, source_id, list(reversed(rows))) == list(reversed(ids))


def test_add_units_retry_fixes_failed_rows_and_keeps_encoded_ones(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    source_id = repo.add_source(db, job_id, "file:///v.mp4")
    ids = repo.add_units(
        db, job_id, source_id, [*unit_rows(2), UnitRow(2, None, None, None, None, error="bad")]
    )
    repo.mark_units_encoded(db, [(ids[0], "key-0", True)])

    # A second ingest: frame 2 decodes now, frame 0 (already encoded) comes with other data.
    retry = [UnitRow(0, 1, 1, "other.png", 999), *unit_rows(1, start=1), *unit_rows(1, start=2, tokens=50)]
    assert repo.add_units(db, job_id, source_id, retry) == ids
    job = counters(db, job_id)
    assert (job["units_total"], job["units_failed"], job["units_pending"]) == (3, 0, 4)  # + the hold
    assert job["visual_tokens"] == 250
    with db.session(readonly=True) as session:
        kept, fixed = by_id(session, UNITS, ids[0]), by_id(session, UNITS, ids[2])
        assert (kept.status, kept.image_key, kept.cache_key) == ("encoded", "img/0.png", "key-0")
        assert (fixed.status, fixed.error, fixed.visual_tokens) == ("pending", None, 50)


def test_add_units_rejects_bad_input(db: Database) -> None:
    job_id, source_id, _ = job_with_units(db, 1)
    with pytest.raises(ValueError, match="twice"):
        repo.add_units(db, job_id, source_id, [*unit_rows(1), *unit_rows(1)])
    other_job = repo.create_job(db, SPEC)
    with pytest.raises(ValueError, match="belongs to job"):
        repo.add_units(db, other_job, source_id, unit_rows(1))
    assert repo.add_units(db, job_id, source_id, []) == []


def test_mark_units_encoded_counts_cache_once(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 4)
    items = [(ids[0], "k0", True), (ids[1], "k1", True), (ids[2], "k2", False)]
    assert repo.mark_units_encoded(db, items) == 3
    assert repo.mark_units_encoded(db, items) == 0
    job = counters(db, job_id)
    assert (job["cache_hits"], job["cache_misses"]) == (2, 1)
    assert [task.unit_id for task in repo.units_in_state(db, job_id, UnitStatus.PENDING)] == [ids[3]]
    generate = repo.units_in_state(db, job_id, UnitStatus.ENCODED)
    assert [(task.unit_id, task.cache_key) for task in generate] == [
        (ids[0], "k0"),
        (ids[1], "k1"),
        (ids[2], "k2"),
    ]
    assert repo.mark_units_encoded(db, []) == 0


def test_units_in_state_are_ordered(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    b = repo.add_source(db, job_id, "file:///b.mp4")
    a = repo.add_source(db, job_id, "file:///a.pdf")
    b_ids = repo.add_units(db, job_id, b, list(reversed(unit_rows(3))))
    repo.complete_source(db, b, kind="video", sha256="b" * 64, size=1)
    a_ids = repo.add_units(db, job_id, a, unit_rows(2))
    tasks = repo.units_in_state(db, job_id, UnitStatus.PENDING)
    assert [(t.source_uri, t.index) for t in tasks] == [
        ("file:///a.pdf", 0),
        ("file:///a.pdf", 1),
        ("file:///b.mp4", 0),
        ("file:///b.mp4", 1),
        ("file:///b.mp4", 2),
    ]
    first_video = tasks[2]
    assert first_video.unit_id == b_ids[2]
    assert (first_video.kind, first_video.width, first_video.height) == ("video", 640, 480)
    assert (first_video.image_key, first_video.visual_tokens, first_video.timestamp) == (
        "img/0.png",
        100,
        0.0,
    )
    assert (first_video.job_id, first_video.source_id, first_video.cache_key, first_video.cache_hit) == (
        job_id,
        b,
        None,
        None,
    )
    assert len(repo.units_in_state(db, job_id, UnitStatus.PENDING, limit=2)) == 2
    assert repo.units_in_state(db, job_id, UnitStatus.ENCODED) == []
    repo.mark_units_encoded(db, [(a_ids[1], "k", False)])
    assert [t.unit_id for t in repo.units_in_state(db, job_id, UnitStatus.ENCODED)] == [a_ids[1]]


def test_fail_units_counts_once_and_counts_down(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 3)
    repo.mark_units_encoded(db, [(ids[1], "k1", False)])
    assert repo.fail_units(db, [(ids[0], "tower crashed"), (ids[1], "bad embeddings")]) == {job_id: 1}
    assert repo.fail_units(db, [(ids[0], "again")]) == {}
    job = counters(db, job_id)
    assert (job["units_failed"], job["units_pending"]) == (2, 1)
    with db.session(readonly=True) as session:
        unit = by_id(session, UNITS, ids[0])
        assert (unit.status, unit.error) == ("failed", "tower crashed")
    # finish_units no longer touches failed units.
    assert repo.finish_units(db, ids) == {job_id: 0}
    assert counters(db, job_id)["units_pending"] == 0


def test_fail_units_spans_jobs_and_done_units(db: Database) -> None:
    job_a, _, ids_a = job_with_units(db, 2)
    job_b, _, ids_b = job_with_units(db, 2, uri="file:///b.pdf")
    repo.finish_units(db, [ids_a[0]])
    left = repo.fail_units(db, [(ids_a[0], "late failure"), (ids_a[1], "x"), (ids_b[0], "y")])
    assert left == {job_a: 0, job_b: 1}
    assert counters(db, job_a)["units_failed"] == 2
    assert counters(db, job_a)["units_pending"] == 0


# --- fan-in --------------------------------------------------------------------------------------


def test_finish_units_reaches_zero_exactly_once(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 10)
    seen = [repo.finish_units(db, ids[i : i + 3])[job_id] for i in range(0, 10, 3)]
    assert seen == [7, 4, 1, 0]
    assert seen.count(0) == 1
    # A retried call changes nothing and does not count down again.
    assert repo.finish_units(db, ids[:3]) == {}
    assert counters(db, job_id)["units_pending"] == 0
    assert repo.finish_units(db, []) == {}


def test_finish_units_counts_each_job_down(db: Database) -> None:
    job_a, _, ids_a = job_with_units(db, 2)
    job_b, _, ids_b = job_with_units(db, 2, uri="file:///b.pdf")
    assert repo.finish_units(db, [ids_a[0], *ids_b]) == {job_a: 1, job_b: 0}
    assert repo.finish_units(db, ids_a) == {job_a: 0}


def test_concurrent_finishers_see_zero_once(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 120)
    chunks = [ids[i : i + 5] for i in range(0, len(ids), 5)]
    seen: list[int] = []
    lock = threading.Lock()

    def worker(mine: list[list[int]]) -> None:
        for chunk in mine:
            left = repo.finish_units(db, chunk)[job_id]
            with lock:
                seen.append(left)

    threads = [threading.Thread(target=worker, args=(chunks[k::6],)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(seen) == len(chunks)
    assert seen.count(0) == 1
    assert sorted(seen, reverse=True) == list(range(115, -1, -5))


# --- results -------------------------------------------------------------------------------------


def test_upsert_results_twice_updates_never_duplicates(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 2)
    rows = [result(u, p) for u in ids for p in range(2)]
    assert repo.upsert_results(db, job_id, rows) == 4
    before = counters(db, job_id)
    retry = [result(ids[0], 0, text="second try"), result(ids[1], 1, error="schema mismatch")]
    assert repo.upsert_results(db, job_id, retry) == 2
    assert count_rows(db, RESULTS, job_id) == 4
    assert counters(db, job_id) | {"updated_at": None} == before | {"updated_at": None}
    by_key = {(r["unit"], r["prompt_index"]): r for r in repo.iter_results(db, job_id)}
    assert by_key[(0, 0)]["text"] == "second try"
    assert by_key[(0, 0)]["output"] == {"answer": "second try", "unit": ids[0]}
    assert by_key[(1, 1)]["error"] == "schema mismatch"
    assert by_key[(1, 1)]["output"] is None
    assert repo.upsert_results(db, job_id, []) == 0


def test_store_results_refuses_a_cancelled_job(db: Database) -> None:
    """After `visbatch cancel` commits, nothing of that job is stored, even answers the engine had
    already given (the generate loop polls only once a second); other jobs of the flush are."""
    live, _, live_units = job_with_units(db, 2)
    cancelled, _, cancelled_units = job_with_units(db, 2, uri="file:///docs/b.pdf")
    repo.set_job_status(db, cancelled, "cancelled", error="cancelled by the user")
    rows = [(live, result(u)) for u in live_units] + [(cancelled, result(u)) for u in cancelled_units]
    units = [(live, u) for u in live_units] + [(cancelled, u) for u in cancelled_units]
    stored = repo.store_results(db, rows, units)
    assert stored.refused == {cancelled}
    assert stored.remaining == {live: 0}
    assert count_rows(db, RESULTS, live) == 2 and count_rows(db, RESULTS, cancelled) == 0
    assert repo.units_in_state(db, cancelled, UnitStatus.PENDING)  # untouched: a resume does them
    assert counters(db, cancelled)["first_result_at"] is None


def test_upsert_results_keeps_last_of_repeated_keys(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 1)
    repo.upsert_results(db, job_id, [result(ids[0], 0, text="a"), result(ids[0], 0, text="b")])
    assert [r["text"] for r in repo.iter_results(db, job_id)] == ["b"]


def test_upsert_results_json_values(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 1)
    outputs: list[Any] = [["a", 1, None], "just text", 3.5, {"nested": {"deep": [True, False]}}]
    rows = [
        ResultRow(ids[0], p, out, None, None, 1, 1, 1, None, "m", "vllm", True, 0.0)
        for p, out in enumerate(outputs)
    ]
    repo.upsert_results(db, job_id, rows)
    assert [r["output"] for r in repo.iter_results(db, job_id)] == outputs


def test_bulk_upsert_of_5000_results_is_one_statement(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    source_id = repo.add_source(db, job_id, "file:///big.pdf")
    ids = repo.add_units(db, job_id, source_id, unit_rows(1250))
    rows = [result(u, p) for u in ids for p in range(4)]
    statements: list[tuple[str, bool]] = []

    def record(
        _conn: Any, _cursor: Any, statement: str, _params: Any, _context: Any, executemany: bool
    ) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO RESULTS"):
            statements.append((statement, executemany))

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        started = time.perf_counter()
        assert repo.upsert_results(db, job_id, rows) == 5000
        elapsed = time.perf_counter() - started
        assert repo.upsert_results(db, job_id, rows) == 5000
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    assert len(statements) == 2 and all(executemany for _, executemany in statements)
    assert count_rows(db, RESULTS, job_id) == 5000
    assert elapsed < 30, f"5,000 results took {elapsed:.1f}s"


# --- closing -------------------------------------------------------------------------------------


def test_close_job_succeeded(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 3)
    run_to_end(db, job_id, ids, prompts=2)
    assert repo.close_job(db, job_id) == "succeeded"
    job = counters(db, job_id)
    assert (job["results_total"], job["results_failed"]) == (6, 0)
    assert (job["prompt_tokens"], job["completion_tokens"], job["visual_tokens"]) == (60, 30, 300)
    assert (job["cache_hits"], job["cache_misses"]) == (0, 3)
    finished = job["finished_at"]
    assert finished is not None
    assert repo.close_job(db, job_id) == "succeeded"
    assert counters(db, job_id)["finished_at"] == finished


def test_close_job_partial(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 3)
    run_to_end(db, job_id, ids[:2])
    repo.fail_units(db, [(ids[2], "tower out of memory")])
    assert repo.close_job(db, job_id) == "partial"


def test_close_job_partial_on_failed_result_or_source(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 2)
    run_to_end(db, job_id, ids)
    repo.upsert_results(db, job_id, [result(ids[1], 0, error="invalid JSON")])
    assert repo.close_job(db, job_id) == "partial"

    job_id, _, ids = job_with_units(db, 1)
    run_to_end(db, job_id, ids)
    broken = repo.add_source(db, job_id, "file:///broken.pdf")
    repo.complete_source(db, broken, error="encrypted")
    assert repo.close_job(db, job_id) == "partial"


def test_close_job_failed(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 2)
    repo.upsert_results(db, job_id, [result(u, error="engine error") for u in ids])
    repo.finish_units(db, ids)
    assert repo.close_job(db, job_id) == "failed"
    job = counters(db, job_id)
    assert job["error"] and "no successful result" in job["error"]
    assert (job["results_total"], job["results_failed"]) == (2, 2)

    empty = repo.create_job(db, SPEC)
    assert repo.close_job(db, empty) == "failed"
    assert counters(db, empty)["error"] == "no input files found"


def test_close_job_keeps_cancelled_and_repairs_counters(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 2)
    run_to_end(db, job_id, ids)
    repo.set_job_status(db, job_id, "cancelled")
    with db.session() as session:  # simulate drifted counters
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(units_pending=7, sources_total=0))
    assert repo.close_job(db, job_id) == "cancelled"
    job_row = counters(db, job_id)
    assert (job_row["units_pending"], job_row["sources_total"], job_row["units_total"]) == (0, 1, 2)
    with pytest.raises(JobNotFound):
        repo.close_job(db, "d" * 32)


# --- reading -------------------------------------------------------------------------------------


def test_job_summary_errors_and_counts(db: Database) -> None:
    job_id, source_id, ids = job_with_units(db, 3)
    broken = repo.add_source(db, job_id, "file:///broken.pdf")
    repo.complete_source(db, broken, error="not a PDF")
    repo.fail_units(db, [(ids[2], "decode failed")])
    repo.mark_units_encoded(db, [(ids[0], "k0", True), (ids[1], "k1", False)])
    repo.upsert_results(db, job_id, [result(ids[0]), result(ids[1], error="invalid JSON")])

    summary = repo.job_summary(db, job_id)
    assert summary["id"] == job_id and summary["status"] == "queued"
    assert summary["spec"] == SPEC
    assert summary["created_at"].endswith("+00:00") and summary["finished_at"] is None
    assert (summary["sources_total"], summary["sources_failed"]) == (2, 1)
    assert (summary["units_total"], summary["units_failed"]) == (3, 1)
    assert (summary["results"], summary["results_failed"]) == (1, 1)  # live, before close
    assert (summary["cache_hits"], summary["cache_misses"]) == (1, 1)
    assert (summary["visual_tokens"], summary["prompt_tokens"], summary["completion_tokens"]) == (300, 20, 10)
    keys = ("source", "unit", "prompt", "message")
    assert [{k: e[k] for k in keys} for e in summary["errors"]] == [
        {"source": "file:///broken.pdf", "unit": None, "prompt": None, "message": "not a PDF"},
        {"source": "file:///docs/a.pdf", "unit": 2, "prompt": None, "message": "decode failed"},
        {"source": "file:///docs/a.pdf", "unit": 1, "prompt": 0, "message": "invalid JSON"},
    ]
    # Where, as a person reads it: PDF pages from 1 (`unit` stays the 0-based index), the prompt's text.
    kinds = [(e["kind"], e["page_number"], e["prompt_text"]) for e in summary["errors"]]
    assert kinds == [(None, None, None), ("pdf", 3, None), ("pdf", 2, SPEC["prompts"][0])]
    assert summary["errors_truncated"] is False

    repo.finish_units(db, ids)
    repo.close_job(db, job_id)
    closed = repo.job_summary(db, job_id)
    assert closed["status"] == "partial" and closed["finished_at"] is not None


def test_job_summary_truncates_errors(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 6)
    repo.fail_units(db, [(u, f"failure {i}") for i, u in enumerate(ids)])
    summary = repo.job_summary(db, job_id, max_errors=4)
    assert len(summary["errors"]) == 4 and summary["errors_truncated"] is True
    assert repo.job_summary(db, job_id, max_errors=6)["errors_truncated"] is False


def test_job_lookup_by_prefix(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = iter(["abcdef0123456789abcdef0123456789", "abcdef9999999999999999999999999a"])
    monkeypatch.setattr(storage.jobs, "new_job_id", lambda: next(ids))
    first = repo.create_job(db, SPEC)
    second = repo.create_job(db, SPEC)
    assert repo.job_summary(db, "abcdef0")["id"] == first
    assert repo.job_summary(db, "ABCDEF9")["id"] == second
    assert repo.resolve_job_id(db, first) == first
    with pytest.raises(JobNotFound, match="ambiguous"):
        repo.job_summary(db, "abcdef")
    with pytest.raises(JobNotFound, match="at least 6"):
        repo.job_summary(db, "abcd")
    with pytest.raises(JobNotFound):
        repo.job_summary(db, "abc%ef")
    with pytest.raises(JobNotFound):
        repo.job_summary(db, "123456")
    with pytest.raises(KeyError):  # JobNotFound is a KeyError
        repo.iter_results(db, "fedcba")


def test_iter_results_order_and_streaming(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    video = repo.add_source(db, job_id, "file:///z.mp4")
    pdf = repo.add_source(db, job_id, "file:///a.pdf")
    video_ids = repo.add_units(db, job_id, video, unit_rows(3))
    repo.complete_source(db, video, kind="video", sha256="v" * 64, size=1)
    pdf_ids = repo.add_units(db, job_id, pdf, unit_rows(2))
    rows = [result(u, p) for u in reversed(video_ids + pdf_ids) for p in (1, 0)]
    repo.upsert_results(db, job_id, rows)

    stream = repo.iter_results(db, job_id[:8], chunk_size=2)
    got = [(r["source"], r["unit"], r["prompt_index"]) for r in stream]
    expected = [("file:///a.pdf", u, p) for u in range(2) for p in range(2)]
    expected += [("file:///z.mp4", u, p) for u in range(3) for p in range(2)]
    assert got == expected

    first = next(repo.iter_results(db, job_id))
    assert set(first) == {
        "source",
        "kind",
        "unit",
        "timestamp",
        "width",
        "height",
        "prompt_index",
        "output",
        "text",
        "error",
        "prompt_tokens",
        "visual_tokens",
        "completion_tokens",
        "finish_reason",
        "model",
        "engine",
        "cache_hit",
        "latency_ms",
        "pruned_tokens",
        "merged_tokens",
        "scope",
        "unit_to",
        "turn",
        "timestamp_to",
    }
    video_row = [r for r in repo.iter_results(db, job_id) if r["source"] == "file:///z.mp4"][0]
    assert (video_row["kind"], video_row["timestamp"], video_row["width"]) == ("video", 0.0, 640)

    # Abandoning a stream early must release its transaction (the database stays writable).
    partial = repo.iter_results(db, job_id, chunk_size=1)
    next(partial)
    partial.close()
    repo.upsert_results(db, job_id, [result(pdf_ids[0], 0, text="after")])


def test_list_jobs_newest_first(db: Database) -> None:
    made = []
    for _ in range(3):
        made.append(repo.create_job(db, SPEC))
        time.sleep(0.01)
    listed = repo.list_jobs(db, limit=2)
    assert [job["id"] for job in listed] == [made[2], made[1]]
    assert listed[0]["status"] == "queued"
    assert {"created_at", "finished_at", "units_total", "units_pending", "results_total"} <= set(listed[0])
    assert len(repo.list_jobs(db)) == 3


def test_deleting_a_job_cascades(db: Database) -> None:
    job_id, _, ids = job_with_units(db, 2)
    run_to_end(db, job_id, ids)
    with db.session() as session:
        session.execute(delete(JOBS).where(JOBS.c.id == job_id))
    for table in (SOURCES, UNITS, RESULTS):
        assert count_rows(db, table, job_id) == 0


def test_session_rolls_back_on_error(db: Database) -> None:
    job_id = repo.create_job(db, SPEC)
    with pytest.raises(RuntimeError), db.session() as session:
        session.execute(update(JOBS).where(JOBS.c.id == job_id).values(status="running"))
        assert by_id(session, JOBS, job_id).status == "running"
        raise RuntimeError("boom")
    assert counters(db, job_id)["status"] == "queued"
