"""The Celery app of the fleet: one queue per stage, JSON only, safe for long GPU tasks.

Settings that come from real incidents (see DESIGN.md):
- acks_late + reject_on_worker_lost: a task whose worker dies (OOM killer, SIGKILL, node
  loss) goes back to the queue instead of being lost;
- the Redis visibility timeout is above the hard time limit, or Redis would hand a task that
  is still running to a second worker (celery#5935);
- prefetch 1, so a GPU worker never sits on tasks another worker could run; the generate
  queue is the exception (its worker must hold a batch's worth of messages to pack them);
- JSON serialization only: no pickle anywhere, tensors travel through the token cache.
"""

from __future__ import annotations

from celery import Celery

from storage.settings import Settings

QUEUES = ("ingest", "encode", "generate")


def make_celery(settings: Settings) -> Celery:
    if settings.visibility_timeout <= settings.task_time_limit:
        raise ValueError(
            f"VISBATCH_VISIBILITY_TIMEOUT ({settings.visibility_timeout}s) must be above "
            f"VISBATCH_TASK_TIME_LIMIT ({settings.task_time_limit}s), or Redis redelivers running tasks"
        )
    app = Celery("visbatch", broker=settings.broker_url, include=["worker.tasks"])
    transport = {
        "visibility_timeout": settings.visibility_timeout,
        "unacked_restore_interval": settings.unacked_restore_interval,
        "unacked_restore_throttle": 1,
        "socket_timeout": 30,
        "socket_connect_timeout": 10,
        "health_check_interval": 25,
    }
    if settings.broker_prefix:
        transport["global_keyprefix"] = settings.broker_prefix
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        # Results live in the database; Celery's result backend is not used.
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_time_limit=settings.task_time_limit,
        task_soft_time_limit=max(1, int(settings.task_time_limit * 0.9)),
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        task_default_queue="ingest",
        task_routes={
            "visbatch.ingest_source": {"queue": "ingest"},
            "visbatch.encode_units": {"queue": "encode"},
            "visbatch.generate_units": {"queue": "generate"},
        },
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    return app


app = make_celery(Settings())
