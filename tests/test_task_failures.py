"""What a fleet task records when it fails for good: the real cause, and what to do about it."""

from __future__ import annotations

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from storage import repository as repo
from worker.drivers.fleet import tasks


@pytest.mark.parametrize("exc", [SoftTimeLimitExceeded(), TimeLimitExceeded(90)])
def test_an_ingest_over_the_time_limit_names_the_setting(db, monkeypatch, exc):
    monkeypatch.setattr(tasks, "_db", lambda: db)
    video = "s3://bucket/long.mp4"
    started = repo.start_job(db, {"prompts": ["p"]}, [(video, None)])
    [(source_id, _)] = started.sources
    tasks.ingest_source.on_failure(exc, "task-1", (started.job_id, source_id, video), {}, None)
    summary = repo.job_summary(db, started.job_id)
    assert summary["status"] == "failed"
    [error] = [e["message"] for e in summary["errors"]]
    assert "longer than the task time limit (VISBATCH_TASK_TIME_LIMIT" in error
    assert "--max-frames" in error
