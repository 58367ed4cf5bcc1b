"""A failure means the same under both drivers (issue 22): when a stage's last try fails, its
`give_up` fails the source or the units with the real cause and the job goes on, in the fleet
(the Celery tasks' on_failure, tests/test_task_failures.py) and in one process (the embedded
run, here, on the tiny model and real SQLite). The errors are injected into the real stage
functions: an unexpected error in the splitting step, a result write the database refuses."""

from __future__ import annotations

import time

import pytest

from ingest.spec import JobSpec, Sampling
from storage import repository as repo
from storage.models import UnitStatus
from tests.media import write_pdf
from worker.drivers import embedded
from worker.drivers.embedded import run_job
from worker.runtime import Runtime

pytestmark = pytest.mark.slow

SPEC = JobSpec(prompts=["What is on this page?"], sampling=Sampling(max_new_tokens=4))


def test_an_ingest_error_fails_its_source_and_the_job_goes_on(settings_factory, tmp_path, monkeypatch):
    folder = tmp_path / "in"
    folder.mkdir()
    write_pdf(folder / "broken.pdf", pages=2)
    write_pdf(folder / "fine.pdf", pages=2)
    real = embedded.ingest_source

    def ingest_source(rt, job_id, source_id, uri, path, spec, **kw):
        if path.name == "broken.pdf" or uri.endswith("broken.pdf"):
            raise RuntimeError("a bug in the splitting step")
        return real(rt, job_id, source_id, uri, path, spec, **kw)

    monkeypatch.setattr(embedded, "ingest_source", ingest_source)
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [folder], SPEC)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "partial", summary  # not `failed` with the run's error
    [error] = [e["message"] for e in summary["errors"]]
    assert error == "ingest failed: RuntimeError: a bug in the splitting step"
    assert summary["results"] == 2  # fine.pdf's two pages answered


def test_results_the_database_refuses_fail_their_units_and_the_job_goes_on(
    settings_factory, tmp_path, monkeypatch
):
    folder = tmp_path / "in"
    folder.mkdir()
    write_pdf(folder / "doc.pdf", pages=3)
    real = repo.store_results
    calls = []

    def store_results(db, rows, units, *settled):
        calls.append(len(units))
        if len(calls) == 1:
            raise ValueError("value too long for the column")  # permanent: not retried
        return real(db, rows, units, *settled)

    monkeypatch.setattr(repo, "store_results", store_results)
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [folder], SPEC)
    summary = repo.job_summary(rt.db, job_id)
    failed = [e["message"] for e in summary["errors"]]
    # The units of the refused write's submission that were still waiting fail (as a fleet task's
    # on_failure fails its units still encoded); every page ends answered or failed, never both.
    assert failed and set(failed) == {"generate failed: ValueError: value too long for the column"}
    assert summary["results"] + len(failed) == 3
    assert summary["status"] in ("partial", "failed") and summary["units_failed"] == len(failed)
    assert "resume" not in (summary.get("error") or "")  # the job ended; the run did not fail


class _Answered:
    """The progress a resumed run reports, last state per stage (what the CLI's bars show)."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int | None]] = {}

    @property
    def generate(self) -> tuple[int, int | None] | None:
        return self.last.get("generate")

    def update(self, stage: str, done: int, total: int | None = None) -> None:
        self.last[stage] = (done, total)

    def note(self, message: str) -> None:
        pass


def _stopped_with_encoded_units(rt: Runtime, folder, monkeypatch) -> str:
    """A job whose first run stopped (as on a Ctrl-C) when its first answers were being written:
    its pages are encoded, none answered."""
    run = embedded.EmbeddedRun(rt)
    real = repo.store_results

    def stop_at_first_write(db, rows, units, *settled):
        run.request_stop("interrupted by SIGINT (Ctrl-C)")
        # Transient: retried with backoff, which the stop must cut short (it waited out minutes
        # of backoff before the generate loop's retries heard the stop).
        raise ConnectionError("the database went away")

    monkeypatch.setattr(repo, "store_results", stop_at_first_write)
    started = time.monotonic()
    job_id = run.run([folder], SPEC)
    assert time.monotonic() - started < 60
    monkeypatch.setattr(repo, "store_results", real)
    assert repo.job_state(rt.db, job_id)[0] == "cancelled"
    assert repo.units_in_state(rt.db, job_id, UnitStatus.ENCODED), "no unit left encoded"
    return job_id


def test_resume_answers_the_units_a_stopped_run_had_encoded(settings_factory, tmp_path, monkeypatch, caplog):
    # Issue 31: their done-callback lacked the unit ids (a TypeError logged by concurrent.futures),
    # so the progress stopped short of the answers stored.
    folder = tmp_path / "in"
    folder.mkdir()
    write_pdf(folder / "doc.pdf", pages=3)
    rt = Runtime(settings_factory())
    job_id = _stopped_with_encoded_units(rt, folder, monkeypatch)

    progress = _Answered()
    embedded.EmbeddedRun(Runtime(settings_factory()), progress).resume(job_id)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded" and summary["results"] == 3, summary
    assert progress.generate == (3, 3)
    # Issue 31: `sources 0/0` (only the sources left were counted) and `pages+frames 3/?`.
    assert progress.last["sources"] == (1, 1) and progress.last["units"] == (3, 3), progress.last
    assert "exception calling callback" not in caplog.text


def test_resumed_encoded_units_whose_generation_fails_are_failed_with_the_cause(
    settings_factory, tmp_path, monkeypatch
):
    folder = tmp_path / "in"
    folder.mkdir()
    write_pdf(folder / "doc.pdf", pages=3)
    rt = Runtime(settings_factory())
    job_id = _stopped_with_encoded_units(rt, folder, monkeypatch)
    encoded = len(repo.units_in_state(rt.db, job_id, UnitStatus.ENCODED))

    def refuse(db, rows, units, *settled):
        raise ValueError("value too long for the column")  # permanent: not retried

    monkeypatch.setattr(repo, "store_results", refuse)
    embedded.EmbeddedRun(Runtime(settings_factory())).resume(job_id)
    summary = repo.job_summary(rt.db, job_id)
    failed = [e["message"] for e in summary["errors"]]
    assert summary["units_failed"] == 3 >= encoded, summary  # none left waiting forever
    assert set(failed) == {"generate failed: ValueError: value too long for the column"}
    assert summary["status"] == "failed" and summary["units_pending"] == 0, summary


def test_a_refused_write_of_window_answers_ends_the_job_with_its_cause(
    settings_factory, tmp_path, monkeypatch
):
    """A windowed job (issue 34): the units of the refused write's submissions fail with the
    cause, every other unit's windows are answered (an answer, or the failure of a page they
    hold), and no unit is left waiting: the job ends, explained."""
    folder = tmp_path / "in"
    folder.mkdir()
    write_pdf(folder / "doc.pdf", pages=5)
    real = repo.store_results
    calls = []

    def store_results(db, rows, units, *settled, **kw):
        calls.append(len(rows))
        if len(calls) == 1:
            raise ValueError("value too long for the column")  # permanent: not retried
        return real(db, rows, units, *settled, **kw)

    monkeypatch.setattr(repo, "store_results", store_results)
    rt = Runtime(settings_factory(encode_chunk_units=2))
    job_id = run_job(rt, [folder], SPEC.model_copy(update={"window": "2:1"}))
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] in ("partial", "failed"), summary
    cause = "generate failed: ValueError: value too long for the column"
    failed = {e["unit"] for e in summary["errors"] if e["message"] == cause}
    assert failed and {e["message"] for e in summary["errors"]} == {cause}
    rows = list(repo.iter_results(rt.db, job_id))
    # A window of a failed page is answered with the failure, or not asked at all when every
    # one of its pages failed; the others have their answer. Each window at most once.
    windows = [(r["unit"], r["unit_to"]) for r in rows]
    assert len(windows) == len(set(windows))
    for row in rows:
        held = set(range(row["unit"], row["unit_to"] + 1))
        assert (row["error"] is None) == (not held & failed), (row, failed)
    answered = {u for r in rows for u in range(r["unit"], r["unit_to"] + 1)}
    assert answered | failed == set(range(5))
    assert not repo.units_in_state(rt.db, job_id, UnitStatus.ENCODED)
