"""The fleet's safety net for stuck jobs (worker.drivers.fleet.stall_watch), on SQLite and PostgreSQL.

At this level the broker is three seams: a recorder stands in for sending tasks (what would be put
on each queue), fixed queue states for asking the broker how many messages and workers each queue
has, and a fixed set for the jobs whose messages workers hold (None, as RabbitMQ answers, unless a
test says otherwise; tests/test_broker_redis.py reads a real Redis broker's). "No progress for a
while" is a sweep run at a later `now`, never a sleep.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from storage import jobs
from storage.db import Database
from storage.models import utcnow
from storage.rows import UnitRow
from storage.units import add_units, finish_units, mark_units_encoded
from visbatch.settings import Settings
from worker.drivers.fleet.consumers import QueueState
from worker.drivers.fleet.stall_watch import LOST_AFTER_S, resume_stalled_jobs

SETTINGS = Settings(stall_after_s=120, encode_chunk_units=2)
SERVED = {stage: QueueState(messages=0, consumers=1) for stage in jobs.STAGES}


class Recorder:
    """Stands in for the broker: the tasks a sweep sends, as (stage, args)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple]] = []

    def __call__(self, stage: str, args: tuple) -> None:
        self.sent.append((stage, args))

    def stages(self) -> list[str]:
        return [stage for stage, _ in self.sent]


def _fleet_job(db: Database) -> tuple[str, int, int]:
    """A running fleet job, as a lost message leaves one: source A half-ingested (its cursor at 3,
    units 0-1 stored, unit 1 encoded, unit 2 answered), source B never ingested."""
    spec = {"prompts": ["What is on this page?"], "model": "tiny"}
    started = jobs.start_job(
        db,
        spec,
        [("a.pdf", None), ("b.pdf", None)],
        {"a.pdf": "store:sources/aa/a.pdf", "b.pdf": "s3://in/b.pdf"},
    )
    (source_a, _), (source_b, _) = started.sources
    rows = [
        UnitRow(index=i, width=448, height=448, image_key=f"img/{i}", visual_tokens=256) for i in range(3)
    ]
    unit_ids = add_units(db, started.job_id, source_a, rows)
    mark_units_encoded(db, [(unit_ids[1], "key1", False), (unit_ids[2], "key2", False)])
    finish_units(db, [unit_ids[2]])
    from sqlalchemy import update

    from storage.models import SOURCES

    with db.session() as session:
        session.execute(update(SOURCES).where(SOURCES.c.id == source_a).values(next_unit=3))
    return started.job_id, source_a, source_b


def _sweep(db: Database, later: float, recorder: Recorder, states=None, held=None):
    return resume_stalled_jobs(
        db,
        SETTINGS,
        send=recorder,
        states=lambda stages: states if states is not None else SERVED,
        held=lambda: held,
        now=utcnow() + timedelta(seconds=later),
    )


def test_a_stalled_job_is_resumed_once_and_not_again_within_the_threshold(db):
    job_id, source_a, source_b = _fleet_job(db)
    recorder = Recorder()

    # Moving (its last progress a minute ago): left alone.
    assert _sweep(db, 60, recorder) == [] and recorder.sent == []

    # Three minutes without progress: its work is sent again, exactly what is left.
    (resumed,) = _sweep(db, 180, recorder)
    assert resumed.job_id == job_id and resumed.action == "resumed" and resumed.idle_seconds >= 180
    units = jobs.outstanding_work(db, job_id)
    assert recorder.sent == [
        ("ingest", (job_id, source_a, "store:sources/aa/a.pdf", 3)),  # from its cursor
        ("ingest", (job_id, source_b, "s3://in/b.pdf", 0)),
        ("encode", (job_id, units.pending_units)),
        ("generate", (job_id, units.encoded_units)),
    ]
    assert len(units.pending_units) == 1 and len(units.encoded_units) == 1
    assert jobs.job_summary(db, job_id)["resumed_at"] is not None

    # A minute later, still nothing moved: not sent again (once per threshold, no spam).
    recorder.sent.clear()
    assert _sweep(db, 240, recorder) == [] and recorder.sent == []
    # A threshold after the resume, still stuck: resumed again.
    assert [r.job_id for r in _sweep(db, 180 + 121, recorder)] == [job_id]


def test_a_job_that_progresses_or_is_finished_is_left_alone(db):
    job_id, _, _ = _fleet_job(db)
    recorder = Recorder()
    # Progress two minutes from now (any stage moving the job row), then a sweep a minute after it.
    jobs.add_stage_seconds(db, job_id, "encode", 1.0)
    from sqlalchemy import update

    from storage.models import JOBS

    with db.session() as session:
        session.execute(
            update(JOBS).where(JOBS.c.id == job_id).values(updated_at=utcnow() + timedelta(seconds=120))
        )
    assert _sweep(db, 180, recorder) == [] and recorder.sent == []

    jobs.set_job_status(db, job_id, "cancelled", error="cancelled by the user")
    assert _sweep(db, 3600, recorder) == [] and recorder.sent == []


def test_a_job_behind_queued_messages_or_without_a_worker_waits(db):
    job_id, _, _ = _fleet_job(db)
    recorder = Recorder()
    backlog = {**SERVED, "encode": QueueState(messages=40, consumers=1)}
    assert _sweep(db, 600, recorder, backlog) == [] and recorder.sent == []
    unserved = {**SERVED, "ingest": QueueState(messages=0, consumers=0)}
    assert _sweep(db, 600, recorder, unserved) == [] and recorder.sent == []
    # Neither was counted as a resume: once the queues are drained and served, it is resumed.
    assert [r.job_id for r in _sweep(db, 600, recorder)] == [job_id]


def test_a_job_whose_messages_the_broker_shows_nowhere_is_sent_again_in_seconds(db):
    # Issue 32: a message a worker had popped and not yet recorded when it was killed was in no
    # record at all; only the threshold (120 s) brought it back. Redis shows every message a job
    # has (its queues, the deliveries workers hold): none anywhere is lost.
    job_id, _, _ = _fleet_job(db)
    recorder = Recorder()
    assert SETTINGS.stall_after_s > LOST_AFTER_S
    assert _sweep(db, LOST_AFTER_S - 5, recorder, held=set()) == []  # not idle long enough
    # A worker holds one of its messages, or the broker cannot tell (RabbitMQ): the threshold waits.
    assert _sweep(db, LOST_AFTER_S + 10, recorder, held={job_id, "other"}) == []
    assert _sweep(db, LOST_AFTER_S + 10, recorder, held=None) == []
    backlog = {**SERVED, "ingest": QueueState(messages=2, consumers=1)}
    assert _sweep(db, LOST_AFTER_S + 10, recorder, backlog, held=set()) == []
    assert recorder.sent == []

    (lost,) = _sweep(db, LOST_AFTER_S + 10, recorder, held={"another job"})
    assert lost.job_id == job_id and lost.action == "lost"
    units = jobs.outstanding_work(db, job_id)
    assert recorder.stages() == ["ingest", "ingest", "encode", "generate"]  # what is left, once
    assert recorder.sent[2:] == [
        ("encode", (job_id, units.pending_units)),
        ("generate", (job_id, units.encoded_units)),
    ]
    # Not again before it had the time to move; the threshold's resume still comes after that.
    recorder.sent.clear()
    assert _sweep(db, LOST_AFTER_S + 20, recorder, held=set()) == [] and recorder.sent == []
    assert [r.action for r in _sweep(db, 2 * LOST_AFTER_S + 15, recorder, held=set())] == ["lost"]


def test_sent_again_as_lost_a_failed_unit_stays_failed(db):
    """Only the lost messages go again: unlike the threshold's resume (visbatch resume's), a failed
    unit is not retried, and a job with nothing left to send waits for the threshold to close it."""
    from storage.units import fail_units

    job_id, _, _ = _fleet_job(db)
    pending = jobs.outstanding_work(db, job_id).pending_units
    fail_units(db, [(unit_id, "unreadable page") for unit_id in pending])
    recorder = Recorder()
    (lost,) = _sweep(db, LOST_AFTER_S + 10, recorder, held=set())
    assert lost.action == "lost" and "encode" not in recorder.stages()
    assert jobs.outstanding_work(db, job_id).pending_units == []


def test_a_job_with_nothing_left_but_never_closed_is_closed(db):
    spec = {"prompts": ["Hi"], "model": "tiny"}
    started = jobs.start_job(db, spec, [("a.png", None)], {"a.png": "store:sources/aa/a.png"})
    (source_id, _) = started.sources[0]
    from storage.sources import complete_source

    complete_source(db, source_id, error="ingest failed: a lost countdown")
    # The countdown reached 0 but the close was lost: the job is still running.
    jobs.set_job_status(db, started.job_id, "running")
    recorder = Recorder()
    (closed,) = _sweep(db, 180, recorder)
    assert closed.action == "closed" and recorder.sent == []
    assert jobs.job_summary(db, started.job_id)["status"] == "failed"


def test_a_job_run_in_one_process_is_not_the_fleets(db):
    """An embedded run records no locations: the fleet never takes it over."""
    spec = {"prompts": ["Hi"], "model": "tiny"}
    started = jobs.start_job(db, spec, [("/home/me/a.pdf", None)])
    recorder = Recorder()
    assert _sweep(db, 3600, recorder) == [] and recorder.sent == []
    assert jobs.job_summary(db, started.job_id)["fleet"] is False


@pytest.mark.postgres
def test_one_sweeper_at_a_time_on_postgresql(postgres_db):
    """While one sweep holds the advisory lock, another sweep does nothing."""
    from sqlalchemy import text

    from worker.drivers.fleet.stall_watch import SWEEP_LOCK_KEY

    job_id, _, _ = _fleet_job(postgres_db)
    recorder = Recorder()
    with postgres_db.session() as session:
        assert session.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": SWEEP_LOCK_KEY})
        assert _sweep(postgres_db, 600, recorder) == [] and recorder.sent == []
    assert [r.job_id for r in _sweep(postgres_db, 600, recorder)] == [job_id]


def test_shipped_redis_defaults_redeliver_within_about_two_minutes():
    """A dead worker's messages come back after the visibility timeout plus at most one restore
    sweep (measured ~10 s more): about two minutes; and no task outlives the timeout."""
    shipped = Settings()
    assert shipped.visibility_timeout + shipped.unacked_restore_interval <= 110
    assert shipped.task_time_limit < shipped.visibility_timeout
    assert shipped.stall_after_s == 120
