"""GenerateService's hand-over between submitting threads and its own thread.

A stage is handed only what it declares (worker.stages.needs), so these tests hand the service a
stand-in with an engine that never has work: no model, no database (nothing here reaches them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ingest.spec import JobSpec
from worker.stages.generate import GenerateService, JobUnits, ServiceClosed, UnitIds, UnitsOutcome

SPEC = JobSpec(prompts=["What is this?"])


def _idle_needs() -> SimpleNamespace:
    engine = SimpleNamespace(unfinished=False, request_abort=lambda ids: None)
    return SimpleNamespace(
        engine=engine, requests=None, generate_window=8, db=None, retry=None, token_store=None
    )


def test_a_closed_service_refuses_a_submission_at_once():
    service = GenerateService(_idle_needs())
    service.close(timeout=5)
    with pytest.raises(ServiceClosed):
        service.submit(UnitIds([1, 2], SPEC)).result(timeout=5)


def test_a_submission_that_races_the_services_end_is_refused_not_left_waiting():
    """The submitter saw the service open, then its thread drained the inbox for the last time and
    ended: the submission must be refused (a fleet task requeues it), never put where no one will
    answer it (the task thread would wait forever, and a warm-stopping worker with it)."""
    service = GenerateService(_idle_needs())
    service.close(timeout=5)
    assert not service.alive
    service._closing.clear()  # as the submitter saw it, an instant before close()
    future = service.submit(UnitIds([1], SPEC))
    with pytest.raises(ServiceClosed):
        future.result(timeout=5)


def test_an_empty_submission_is_done_at_once():
    service = GenerateService(_idle_needs())
    try:
        assert service.submit(JobUnits([], SPEC)).result(timeout=5) == UnitsOutcome()
    finally:
        service.close(timeout=5)
