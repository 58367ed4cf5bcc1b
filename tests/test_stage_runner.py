"""One runner, one meaning of failure (issue 33): each stage's failures, under both drivers, end
the same way, as dramatiq tests its retries against a stub broker.

For each stage (ingest, encode, generate) and each case (a transient error then success, a
transient error until given up, a permanent error, a missing object, the job finished meanwhile),
the stage's body is a script of errors and the rows are real (SQLite). The embedded side is the
embedded driver's own code path (`EmbeddedRun._tries`, and `_try_generate` whose tries end in a
Future); the fleet side is the real Celery tasks run eagerly (`Task.apply`: a retry runs again at
once, with the message's retry count). Mocked, because they cannot matter here: the splitting,
the vision tower and the engine (each stage's body), and the runtime that would load a model.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy.exc
from sqlalchemy import select

from ingest.spec import JobSpec
from storage import repository as repo
from storage.models import SOURCES, UNITS, UnitStatus
from storage.object_store import ObjectNotFound
from storage.rows import UnitRow
from worker.drivers.embedded import EmbeddedRun
from worker.drivers.fleet import tasks
from worker.retry import RetryPolicy
from worker.stages import encode as encode_module
from worker.stages import ingest as ingest_module
from worker.stages.failures import ENCODE, INGEST, SourceWork
from worker.stages.generate import JobUnits, UnitsOutcome
from worker.stages.ingest import IngestStep
from worker.stages.runner import RetriesSpent, UnitsWork

SPEC = JobSpec(prompts=["What is on this page?"])
TRIES = 3  # two retries
FAST = RetryPolicy(max_retries=TRIES - 1, backoff_base_s=1.0, backoff_max_s=0.001)
LOCATION = "store:in/a.pdf"


def _down() -> Exception:
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))


def _full() -> Exception:
    return OSError(errno.ENOSPC, "No space left on device", "/data/store/ab/cd.png")


# case -> (errors raised by the body's tries in order, then success; the tries made; what the
# rows say after, None: nothing recorded)
CASES = {
    "transient_then_success": ([_down], 2, None),
    "transient_until_given_up": ([_down] * TRIES, TRIES, f"failed after {TRIES} tries: OperationalError"),
    "permanent": ([lambda: ValueError("a bad image")], 1, "failed: ValueError: a bad image"),
    "missing_object": ([lambda: ObjectNotFound("in/a.pdf")], 1, "not found: in/a.pdf"),
    "job_finished_meanwhile": ([lambda: ValueError("a bad image")], 1, None),
    # A full disk outlasts the tries and is waited out all the same: never a failure (issue 32).
    "disk_full_past_the_tries": ([_full] * (TRIES + 2), TRIES + 3, None),
}


class Script:
    """A stage's body: raises the case's errors one try after another, then succeeds."""

    def __init__(self, db, job_id: str, case: str, value: object) -> None:
        self.db, self.job_id, self.case, self.value = db, job_id, case, value
        self.errors = list(CASES[case][0])
        self.tries = 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.tries += 1
        if self.case == "job_finished_meanwhile":
            repo.set_job_status(self.db, self.job_id, "cancelled", error="cancelled by a user")
        if self.errors:
            raise self.errors.pop(0)()
        return self.value


def _job(db, stage: str) -> tuple[str, int, list[int]]:
    job_id = repo.create_job(db, SPEC)
    source_id = repo.add_source(db, job_id, "a.pdf")
    if stage == "ingest":
        return job_id, source_id, []
    unit_ids = repo.add_units(
        db, job_id, source_id, [UnitRow(i, 64, 64, f"img/{i}.png", 4) for i in range(2)]
    )
    repo.complete_source(db, source_id, kind="pdf", sha256="a" * 64, size=1)
    if stage == "generate":
        repo.mark_units_encoded(db, [(u, f"key-{u}", False) for u in unit_ids])
    return job_id, source_id, unit_ids


def _recorded(db, stage: str, source_id: int, unit_ids: list[int]) -> list[str | None]:
    if stage == "ingest":
        with db.session(readonly=True) as session:
            row = session.execute(
                select(SOURCES.c.status, SOURCES.c.error).where(SOURCES.c.id == source_id)
            ).one()
        return [row.error] if row.status == "failed" else [None]
    stmt = (
        select(UNITS.c.id, UNITS.c.status, UNITS.c.error).where(UNITS.c.id.in_(unit_ids)).order_by(UNITS.c.id)
    )
    with db.session(readonly=True) as session:
        return [row.error if row.status == "failed" else None for row in session.execute(stmt)]


class FakeService:
    """The generate service of both drivers: each submission is one try of the script."""

    def __init__(self, script: Script) -> None:
        self.script = script

    def submit(self, job: object) -> Future:
        future: Future = Future()
        try:
            self.script()
        except Exception as exc:  # noqa: BLE001 - the script's error is the try's outcome
            # The service retried its database calls already: such an error arrives spent.
            future.set_exception(
                RetriesSpent(exc, TRIES) if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
            )
        else:
            future.set_result(UnitsOutcome(stored=2))
        return future


# --- the embedded driver -------------------------------------------------------------------------


def _embedded(db) -> EmbeddedRun:
    return EmbeddedRun(SimpleNamespace(db=db, retry=FAST, settings=SimpleNamespace(lease_s=30.0)))  # type: ignore[arg-type]


def _run_embedded(db, stage: str, job_id: str, source_id: int, unit_ids: list[int], script: Script) -> None:
    run = _embedded(db)
    if stage == "ingest":
        run._tries(INGEST, SourceWork(job_id, source_id, LOCATION), script)
    elif stage == "encode":
        run._tries(ENCODE, UnitsWork(job_id, unit_ids), script)
    else:
        units = repo.units_by_ids(db, unit_ids, UnitStatus.ENCODED)
        settled: Future = Future()
        run._try_generate(FakeService(script), JobUnits(units, SPEC), settled, 1)  # type: ignore[arg-type] - a fake service
        settled.result(timeout=10)


# --- the fleet: the real Celery tasks, eagerly ---------------------------------------------------


@pytest.fixture
def fleet_tasks(monkeypatch):
    def use(db, script: Script) -> None:
        monkeypatch.setattr(tasks, "_db", lambda: db)
        monkeypatch.setattr(tasks, "POLICY", FAST)
        monkeypatch.setattr(tasks, "runtime_for", lambda model: SimpleNamespace(db=db))
        monkeypatch.setattr(tasks, "local_copy", lambda rt, location: contextlib.nullcontext(Path("a.pdf")))
        monkeypatch.setattr(ingest_module, "ingest_source", script)
        monkeypatch.setattr(encode_module, "encode_units", script)
        monkeypatch.setattr(tasks, "_service", lambda rt: FakeService(script))
        for task in (tasks.ingest_source, tasks.encode_units, tasks.generate_units):
            monkeypatch.setattr(task, "apply_async", lambda *a, **k: None)  # the next stage's message

    return use


def _run_fleet(stage: str, job_id: str, source_id: int, unit_ids: list[int]) -> None:
    if stage == "ingest":
        tasks.ingest_source.apply((job_id, source_id, LOCATION))
    elif stage == "encode":
        tasks.encode_units.apply((job_id, unit_ids))
    else:
        tasks.generate_units.apply((job_id, unit_ids))


# --- the contract --------------------------------------------------------------------------------

STAGE_VALUES = {
    "ingest": IngestStep(units_stored=0),
    "encode": SimpleNamespace(encoded=[], failed=0),
    "generate": None,
}


@pytest.mark.parametrize("driver", ["embedded", "fleet"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", ["ingest", "encode", "generate"])
def test_a_failure_means_the_same_under_both_drivers(sqlite_db, fleet_tasks, stage, case, driver):
    if case == "missing_object" and stage != "ingest":
        pytest.skip("only ingest reads an object")
    db = sqlite_db
    job_id, source_id, unit_ids = _job(db, stage)
    if stage == "ingest":
        unit_ids = []
    script = Script(db, job_id, case, STAGE_VALUES[stage])
    if driver == "embedded":
        _run_embedded(db, stage, job_id, source_id, unit_ids, script)
    else:
        fleet_tasks(db, script)
        _run_fleet(stage, job_id, source_id, unit_ids)

    _, tries, expected = CASES[case]
    if stage == "generate" and case.startswith("transient"):
        # The service's own retries were spent on its database call: the submitter never retries
        # it again (retries never nest): one try, given up "after 3 tries" all the same.
        tries, expected = 1, f"failed after {TRIES} tries: OperationalError"
    assert script.tries == tries  # counted, never guessed
    recorded = _recorded(db, stage, source_id, unit_ids)
    if expected is None:
        assert recorded == [None] * len(recorded), recorded
    else:
        name = "" if case == "missing_object" else f"{stage} "
        assert all(r is not None and r.startswith(f"{name}{expected}") for r in recorded), (
            recorded,
            expected,
        )
    if case == "job_finished_meanwhile":
        assert repo.job_state(db, job_id)[0] == "cancelled"  # and its rows as they were


def test_a_stop_records_nothing_and_ends_the_tries(sqlite_db):
    job_id, _, unit_ids = _job(sqlite_db, "encode")
    run = _embedded(sqlite_db)
    stop_after_first = Script(sqlite_db, job_id, "transient_until_given_up", None)

    def body() -> object:
        run.stop.set()  # a Ctrl-C during the try
        return stop_after_first()

    from worker.stages.runner import Stopped

    with pytest.raises(Stopped):
        run._tries(ENCODE, UnitsWork(job_id, unit_ids), body)
    assert stop_after_first.tries == 1
    assert _recorded(sqlite_db, "encode", 0, unit_ids) == [None, None]


def test_a_generate_retry_after_a_transient_error_is_a_new_submission(sqlite_db):
    # A transient error that did not go through the service's retries (the service itself broke
    # on it): the embedded driver submits again after the wait, from a timer, as the fleet does.
    job_id, _, unit_ids = _job(sqlite_db, "generate")
    script = Script(sqlite_db, job_id, "transient_then_success", None)

    class RawService:
        def submit(self, job: object) -> Future:
            future: Future = Future()
            try:
                script()
            except Exception as exc:  # noqa: BLE001
                future.set_exception(exc)
            else:
                future.set_result(UnitsOutcome(stored=2))
            return future

    run = _embedded(sqlite_db)
    settled: Future = Future()
    units = repo.units_by_ids(sqlite_db, unit_ids, UnitStatus.ENCODED)
    run._try_generate(RawService(), JobUnits(units, SPEC), settled, 1)  # type: ignore[arg-type] - a fake service
    settled.result(timeout=10)
    assert script.tries == 2 and threading.active_count() >= 1
    assert _recorded(sqlite_db, "generate", 0, unit_ids) == [None, None]
