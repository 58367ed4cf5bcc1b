"""A retry that cannot be published leaves the message to the broker (issue 19: with the broker
restarting, Celery's `retry` raised Reject(requeue=False) and the source stayed pending forever).

A real Celery app whose broker is a closed port, so the retry's publish really fails in kombu;
the task body raises the database's transient error, as it did in the incident."""

from __future__ import annotations

import pytest
import sqlalchemy.exc
from celery.exceptions import Reject, Retry

from visbatch.settings import Settings
from worker.drivers.fleet.celery_app import make_celery
from worker.drivers.fleet.tasks import StageTask, tried
from worker.stages.failures import INGEST, SourceWork


@pytest.fixture
def app(closed_port: int):
    celery = make_celery(Settings(broker_url=f"redis://127.0.0.1:{closed_port}/0"))
    # Fail the publish after one quick try instead of kombu's default three.
    celery.conf.task_publish_retry_policy = {"max_retries": 1, "interval_start": 0, "interval_step": 0.1}
    celery.conf.broker_transport_options = {
        **celery.conf.broker_transport_options,
        "socket_connect_timeout": 1,
    }
    return celery


class _FlakyTask(StageTask):
    stage = INGEST  # its give_up is never reached: the error is transient and tries remain

    def work(self, args: tuple) -> SourceWork:
        return SourceWork("job", 1, "a.pdf")


def _task(app, body):
    @app.task(bind=True, base=_FlakyTask, name="visbatch.test_flaky")
    @tried
    def flaky(self):
        return body()

    return flaky


def _database_away():
    raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))


def test_an_unpublished_retry_requeues_instead_of_dropping(app):
    task = _task(app, _database_away)
    task.push_request(id="t-1", retries=0, called_directly=False, delivery_info={})
    try:
        with pytest.raises(Reject) as raised:
            task.run()
    finally:
        task.pop_request()
    assert raised.value.requeue is True
    assert "OperationalError" in str(raised.value.reason)


def test_a_published_retry_is_a_plain_retry(app, monkeypatch):
    task = _task(app, _database_away)
    monkeypatch.setattr(StageTask, "apply_async", lambda *a, **k: None)  # the broker took it
    task.push_request(id="t-2", retries=0, called_directly=False, delivery_info={})
    try:
        with pytest.raises(Retry):
            task.run()
    finally:
        task.pop_request()
