"""`visbatch workers` (registered on the main app by ``register``): the fleet's live workers, read
from their heartbeats (worker.drivers.fleet.heartbeats), so that an operator needs no Flower to see which
hosts serve which queues, where their metrics are and what they hold now.

A worker beats every ~30 s and counts as gone once its last beat is FRESH_S (135 s) old, or at
once on a warm shutdown; the jobs in hand are as of its last beat.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from worker.errors import Unavailable, first_line


def shown_duration(seconds: float) -> str:
    """A worker's age in at most 6 characters: 45s, 12m, 3h05m, 2d04h."""
    total = max(0, int(seconds))
    minutes, hours, days = total // 60, total // 3600, total // 86400
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{minutes}m"
    if total < 86400:
        return f"{hours}h{minutes % 60:02d}m"
    return f"{days}d{hours % 24:02d}h"


def _age_s(iso: str, now: datetime) -> float | None:
    try:
        return (now - datetime.fromisoformat(iso)).total_seconds()
    except ValueError:
        return None


def worker_records(cards: list[Any], now: datetime | None = None) -> list[dict[str, Any]]:
    """The live workers as `--json` gives them (one object each, by host then start)."""
    now = now or datetime.now(UTC)
    records = []
    for card in cards:
        up, beat = _age_s(card.started_at, now), _age_s(card.beat_at, now)
        records.append(
            {
                "host": card.host,
                "instance": card.instance,
                "name": card.name,
                "queues": list(card.queues),
                "pid": card.pid,
                "metrics_port": card.metrics_port,
                "started_at": card.started_at,
                "up_s": None if up is None else round(up),
                "jobs": list(card.jobs),
                "last_beat_at": card.beat_at,
                "last_beat_s": None if beat is None else round(beat, 1),
            }
        )
    return records


def workers_table(records: list[dict[str, Any]]) -> Any:
    """The table at 80 columns: nothing cut, a long host name or many jobs wrap in their column."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("host", overflow="fold")
    table.add_column("instance", no_wrap=True)
    table.add_column("queues")  # one a word: a narrow column wraps between them
    table.add_column("pid", justify="right", no_wrap=True)
    table.add_column("metrics", justify="right", no_wrap=True)
    table.add_column("up", justify="right", no_wrap=True)
    table.add_column("jobs in hand", overflow="fold")
    for record in records:
        up = "" if record["up_s"] is None else shown_duration(record["up_s"])
        port = "-" if record["metrics_port"] is None else f":{record['metrics_port']}"
        # A job's first 12 digits, as `visbatch jobs` shows it (any unique prefix works).
        jobs = " ".join(job[:12] for job in record["jobs"]) or "-"
        table.add_row(
            record["host"], record["instance"], " ".join(record["queues"]), str(record["pid"]), port, up, jobs
        )
    return table


def workers(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array, one object per worker.")] = False,
) -> None:
    """List the fleet's live workers.

    Each worker's host, instance id, queues, pid, metrics port, time up and the jobs of the tasks
    it runs, from the heartbeats in the broker (a worker beats every ~30 s; one silent for 135 s
    is gone). Exit 4 when the broker cannot be reached."""
    from visbatch.settings import Settings
    from worker.cli.output import make_console
    from worker.drivers.fleet.heartbeats import live_workers

    settings = Settings()
    try:
        cards = live_workers(settings)
    except Exception as exc:  # the broker's client error, whichever broker: one line, exit 4
        from storage.db import mask_url

        cause = f"{type(exc).__name__}: {first_line(exc)}"
        raise Unavailable(
            f"cannot reach the broker {mask_url(settings.broker_url)}: {cause}",
            "start it (RabbitMQ or Redis), or set VISBATCH_BROKER_URL",
        ) from None
    records = worker_records(cards)
    if as_json:
        print(json.dumps(records, indent=2))  # plain print: never wrapped or styled
    elif records:
        make_console(stderr=False).print(workers_table(records))
    if not records:  # stderr: a script reading stdout gets an empty table or []
        where = f" under the prefix {settings.broker_prefix!r}" if settings.broker_prefix else ""
        make_console(stderr=True).print(
            f"no live worker on this broker{where}; start one: visbatch worker", highlight=False
        )


def register(app: typer.Typer) -> None:
    app.command("workers")(workers)
