"""The fleet's queues and task names, and which broker a URL names: what the app, the stall watch
and the queue checks share, without importing Celery (so none of them imports another)."""

from __future__ import annotations

from visbatch.settings import Settings

QUEUES = ("ingest", "encode", "generate")
TASKS = {
    "ingest": "visbatch.ingest_source",
    "encode": "visbatch.encode_units",
    "generate": "visbatch.generate_units",
}


def queue_name(settings: Settings, stage: str) -> str:
    """The broker queue of a stage (prefixed on RabbitMQ, where key prefixes do not exist)."""
    return f"{settings.broker_prefix}{stage}" if is_amqp(settings.broker_url) else stage


def is_amqp(url: str) -> bool:
    return url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")


def is_plain_redis(url: str) -> bool:
    return url.split("://", 1)[0] == "redis"
