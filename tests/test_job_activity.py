"""What an operator is told when nothing moves: `visbatch status` says a job is stalled or waits
for a worker (instead of an ETA it will not keep), and `visbatch submit` warns when no worker
consumes a queue the job needs. The broker is a real Redis (a unique key prefix, no worker)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from rich.console import Console

from storage import jobs
from storage.models import utcnow
from tests.media import write_pdf
from visbatch.settings import Settings
from worker.cli.output import print_summary
from worker.drivers.fleet.consumers import announce, stages_without_consumer, withdraw
from worker.drivers.job_activity import job_activity

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = Settings(stall_after_s=120)


def _shown(summary: dict) -> str:
    buffer = io.StringIO()
    print_summary(Console(file=buffer, width=200, color_system=None), summary)
    return buffer.getvalue()


def _running_fleet_job(db) -> str:
    started = jobs.start_job(
        db, {"prompts": ["Hi"], "model": "tiny"}, [("a.pdf", None)], {"a.pdf": "s3://in/a.pdf"}
    )
    return started.job_id


def test_status_says_stalled_instead_of_an_eta(db):
    job_id = _running_fleet_job(db)
    summary = jobs.job_summary(db, job_id)
    assert summary["fleet"] is True and summary["outstanding"] == {"ingest": 1, "encode": 0, "generate": 0}

    every_queue_served = {"ingest": 1, "encode": 1, "generate": 1}
    fresh = job_activity(
        SETTINGS, summary, now=utcnow() + timedelta(seconds=30), consumers=every_queue_served
    )
    assert fresh is None  # moving (or not yet late): the ETA stays

    later = utcnow() + timedelta(seconds=192)
    summary["activity"] = job_activity(SETTINGS, summary, now=later, consumers=every_queue_served)
    assert summary["activity"]["state"] == "stalled"
    shown = _shown(summary)
    assert (
        "stalled: no progress for 3m1" in shown  # 3m12s, give or take the test's own seconds
        and f"the fleet resumes it automatically, or run visbatch resume {job_id}" in shown
    ), shown
    assert "time left" not in shown


def test_status_says_which_queue_has_no_worker(db):
    job_id = _running_fleet_job(db)
    summary = jobs.job_summary(db, job_id)
    summary["activity"] = job_activity(SETTINGS, summary, consumers={"ingest": 0, "encode": 1, "generate": 1})
    assert summary["activity"]["queue"] == "ingest"
    assert "waiting: no worker on queue ingest; start one: visbatch worker --queues ingest" in _shown(summary)


def test_a_job_run_in_one_process_is_not_told_to_wait_for_the_fleet(db):
    started = jobs.start_job(db, {"prompts": ["Hi"], "model": "tiny"}, [("/data/a.pdf", None)])
    summary = jobs.job_summary(db, started.job_id)
    activity = job_activity(SETTINGS, summary, now=utcnow() + timedelta(minutes=10))
    assert activity is not None and activity["state"] == "stalled"
    assert "if the process that ran it is gone, run visbatch resume" in activity["message"]


def test_workers_announce_the_queues_they_consume_on_redis(redis_url, redis_prefix):
    settings = Settings(broker_url=redis_url, broker_prefix=redis_prefix)
    assert stages_without_consumer(settings, ["ingest", "encode"]) == ["ingest", "encode"]
    announce(settings, "gpu@host", ["encode", "generate"])
    assert stages_without_consumer(settings, ["ingest", "encode", "generate"]) == ["ingest"]
    withdraw(settings, "gpu@host", ["encode", "generate"])  # a warm shutdown
    assert stages_without_consumer(settings, ["encode"]) == ["encode"]


def test_an_unreachable_broker_gives_no_answer_quickly(closed_port):
    settings = Settings(broker_url=f"redis://127.0.0.1:{closed_port}/0")
    started = time.monotonic()
    assert stages_without_consumer(settings, ["ingest"], timeout=0.5) is None
    assert time.monotonic() - started < 2


def test_submit_with_no_worker_warns_and_still_gives_the_job(tmp_path, redis_url, redis_prefix):
    pdf = write_pdf(tmp_path / "doc.pdf", pages=1)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VISBATCH_")},
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "VISBATCH_HOME": str(tmp_path / "home"),
        "VISBATCH_BROKER_URL": redis_url,
        "VISBATCH_BROKER_PREFIX": redis_prefix,
        "VISBATCH_MODEL": "Qwen/Qwen2-VL-2B-Instruct",  # recorded, never loaded: no worker here
    }
    cli = [sys.executable, "-c", "from worker.cli.main import app; app()"]
    # An encode+generate worker is up (its heartbeat), no ingest worker: the warning names ingest.
    announce(Settings(broker_url=redis_url, broker_prefix=redis_prefix), "gpu@host", ["encode", "generate"])
    done = subprocess.run(
        [*cli, "submit", str(pdf), "-p", "Hi"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert len(job_id) == 32, done.stdout
    assert "no worker consumes queue ingest" in done.stderr, done.stderr
    assert "visbatch worker --queues ingest" in done.stderr

    status = subprocess.run([*cli, "status", job_id], capture_output=True, text=True, env=env, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "waiting: no worker on queue ingest" in status.stdout, status.stdout


def test_rabbitmq_tells_its_consumers(rabbitmq_url):
    import uuid

    from kombu import Connection, Consumer, Queue

    settings = Settings(broker_url=rabbitmq_url, broker_prefix=f"visbatch-test-{uuid.uuid4().hex[:8]}-")
    assert stages_without_consumer(settings, ["ingest", "encode"]) == ["ingest", "encode"]  # none declared
    with Connection(rabbitmq_url) as conn:
        queue = Queue(f"{settings.broker_prefix}encode", auto_delete=True)
        with Consumer(conn.channel(), [queue], callbacks=[lambda body, message: None]):
            assert stages_without_consumer(settings, ["ingest", "encode"]) == ["ingest"]


def test_a_quiet_fleet_job_says_what_it_waits_for_from_the_first_seconds(db):
    # Issue 32: for the two minutes before the stall watch, status gave no reason at all.
    job_id = _running_fleet_job(db)
    summary = jobs.job_summary(db, job_id)
    served = {"ingest": 1, "encode": 1, "generate": 1}
    soon = utcnow() + timedelta(seconds=5)
    assert job_activity(SETTINGS, summary, now=soon, consumers=served, messages={"ingest": 0}) is None
    later = utcnow() + timedelta(seconds=35)
    queued = job_activity(SETTINGS, summary, now=later, consumers=served, messages={"ingest": 3})
    assert queued is not None and queued["state"] == "quiet"
    assert "messages wait in its queues (3 in ingest): the workers are busy or starting" in queued["message"]
    lost = job_activity(SETTINGS, summary, now=later, consumers=served, messages={"ingest": 0})
    assert lost is not None and lost["state"] == "quiet"
    assert lost["message"].startswith("no progress for 3")
    assert "no message of it waits in a queue" in lost["message"]
    assert "the stall watch sends them again once a Redis broker shows none held" in lost["message"]
    assert "and resumes it at 2m00s" in lost["message"]
    assert "time left" not in _shown({**summary, "activity": lost})  # no ETA it would not keep
