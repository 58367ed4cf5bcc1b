"""A failure means the same under both drivers (issue 22): when a stage's last try fails, its
`give_up` fails the source or the units with the real cause and the job goes on, in the fleet
(the Celery tasks' on_failure, tests/test_task_failures.py) and in one process (the embedded
run, here, on the tiny model and real SQLite). The errors are injected into the real stage
functions: an unexpected error in the splitting step, a result write the database refuses."""

from __future__ import annotations

import pytest

from ingest.spec import JobSpec, Sampling
from storage import repository as repo
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

    def store_results(db, rows, units):
        calls.append(len(units))
        if len(calls) == 1:
            raise ValueError("value too long for the column")  # permanent: not retried
        return real(db, rows, units)

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
