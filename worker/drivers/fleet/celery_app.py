"""The Celery app of the fleet: one queue per stage, JSON only, safe for long GPU tasks.

Settings that come from real incidents (see DESIGN.md):
- acks_late + reject_on_worker_lost: a task whose worker dies (OOM killer, SIGKILL, node
  loss) goes back to the queue instead of being lost;
- the Redis visibility timeout is above the hard time limit, or Redis would hand a task that
  is still running to a second worker (celery#5935);
- prefetch 1 per pool slot: a CPU worker holds only what its processes run, and a GPU worker's
  thread pool holds exactly the window of units its engine works on (worker.drivers.fleet.tasks);
- JSON serialization only: no pickle anywhere, tensors travel through the token cache.

Brokers: RabbitMQ (recommended) hands an unacknowledged message to another worker as soon as its
worker's connection drops; Redis only after the visibility timeout, so tasks are kept short (ingest
by page range, generate by unit) and the timeout is minutes, not hours. `VISBATCH_BROKER_PREFIX`
keeps several fleets apart on one broker: a key prefix on Redis, a queue-name prefix on RabbitMQ.
"""

from __future__ import annotations

from celery import Celery

from storage import usage
from visbatch.settings import Settings
from worker.drivers.fleet import broker_redis
from worker.drivers.fleet.queues import QUEUES, TASKS, is_amqp, is_plain_redis, queue_name

__all__ = ["QUEUES", "TASKS", "app", "is_amqp", "is_plain_redis", "make_celery", "queue_name"]

UNACKED_MUTEX_EXPIRE_S = 10


def make_celery(settings: Settings) -> Celery:
    if settings.visibility_timeout <= settings.task_time_limit:
        raise ValueError(
            f"VISBATCH_VISIBILITY_TIMEOUT ({settings.visibility_timeout}s) must be above "
            f"VISBATCH_TASK_TIME_LIMIT ({settings.task_time_limit}s), or Redis redelivers running tasks"
        )
    app = Celery(
        "visbatch",
        broker=settings.broker_url,
        include=[
            "worker.drivers.fleet.tasks",
            # Every worker runs the safety net for stuck jobs once it is ready (a thread); loaded
            # with the tasks at worker start, so that the app imports neither (no import circle).
            "worker.drivers.fleet.stall_watch",
        ],
    )
    transport = {
        "visibility_timeout": settings.visibility_timeout,
        "unacked_restore_interval": settings.unacked_restore_interval,
        "unacked_restore_throttle": 1,
        # The sweep takes kombu's "unacked mutex" for milliseconds, but a worker killed while it
        # held it (SIGKILL, OOM) leaves it to expire: kombu's default 300 s, during which no worker
        # hands back any dead worker's tasks (seen: a job saved only by the stall watch after 2 min).
        # A double restore is harmless (kombu restores a tag in a transaction), so expire it soon.
        "unacked_mutex_expire": UNACKED_MUTEX_EXPIRE_S,
        "socket_timeout": 30,
        "socket_connect_timeout": 10,
        "health_check_interval": 25,
    }
    if settings.broker_prefix and not is_amqp(settings.broker_url):
        transport["global_keyprefix"] = settings.broker_prefix
    if is_amqp(settings.broker_url):
        # Redis-only options would be ignored; AMQP redelivers on a dropped connection instead.
        transport = {"confirm_publish": True}
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
        # Off: after a broker reconnect Celery lowers the prefetch count by the tasks still running
        # and raises it again from each later ack's promise (Consumer.
        # _restore_prefetch_count_after_connection_restart). In a thread pool (the GPU workers)
        # that runs in the task's own thread, whose synchronous basic.qos then reads the consumer's
        # connection beside the event loop (py-amqp is not thread-safe): frames torn apart
        # (UnexpectedFrame) or deliveries swallowed, held unacknowledged until heartbeats failed or
        # the stall watch resumed the job (187 s after a 3-s RabbitMQ cut; issue 32). The cost: for
        # a task's length after a reconnect a worker may hold a message per busy slot more.
        worker_enable_prefetch_count_reduction=False,
        task_time_limit=settings.task_time_limit,
        task_soft_time_limit=max(1, int(settings.task_time_limit * 0.9)),
        broker_transport_options=transport,
        # redis:// gets kombu's transport with its broker-restart crash fixed
        # (worker.drivers.fleet.broker_redis).
        **({"broker_transport": broker_redis.TRANSPORT} if is_plain_redis(settings.broker_url) else {}),
        broker_connection_retry_on_startup=True,
        task_default_queue=queue_name(settings, "ingest"),
        task_routes={task: {"queue": queue_name(settings, stage)} for stage, task in TASKS.items()},
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    return app


app = make_celery(Settings())
usage.watch_celery()  # capacity tests only: a no-op unless VISBATCH_USAGE_DIR
