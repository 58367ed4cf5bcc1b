"""Prometheus metrics of workers and of the embedded run (`--metrics-port`).

The stages count what they do (worker.stages: units, results, tokens, engine time); the token
store counts cache lookups by tier; at scrape time two collectors read what is not a count of
this process's work: the depth of each queue (asked of the broker by the worker, of its own
queues by the embedded run: each driver hands its collector in) and how many jobs are in each
state (the database). This module knows no driver. Names follow Prometheus' conventions:
`visbatch_` prefix, `_total` on counters, units in the name (`_seconds`).

A prefork ingest worker runs its tasks in child processes: `serve` then uses prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, which `visbatch worker` sets before this module is
imported), so the parent's endpoint sums its children. Threads (GPU workers, the embedded run)
need nothing of the kind.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

log = logging.getLogger(__name__)

UNITS = Counter("visbatch_units_total", "Pages and frames through a stage, by outcome.", ["stage", "outcome"])
RESULTS = Counter("visbatch_results_total", "Answers stored, by outcome (ok or error).", ["outcome"])
TOKENS = Counter("visbatch_tokens_total", "Tokens, by kind (visual, prompt, completion).", ["kind"])
CACHE_LOOKUPS = Counter(
    "visbatch_cache_lookups_total", "Visual-token cache lookups, by tier and result.", ["tier", "result"]
)
TOWER_IMAGES = Counter("visbatch_tower_images_total", "Images encoded by the vision tower (cache misses).")
ERRORS = Counter(
    "visbatch_errors_total", "Failures recorded on units and answers, by stage and kind.", ["stage", "kind"]
)
RETRIES = Counter("visbatch_retries_total", "Transient errors retried, by what was retried.", ["what"])
STAGE_BUSY = Counter("visbatch_stage_busy_seconds_total", "Seconds each stage spent working.", ["stage"])
ENGINE_BUSY = Counter(
    "visbatch_engine_busy_seconds_total",
    "Seconds the generation engine had requests in flight (its rate is the engine's busy share).",
)
IN_FLIGHT = Gauge(
    "visbatch_requests_in_flight", "Generation requests in the engine now.", multiprocess_mode="livesum"
)
REQUEST_SECONDS = Histogram(
    "visbatch_request_duration_seconds",
    "Time from a request entering the engine to its answer.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300),
)


class QueueDepthCollector(Collector):
    """`visbatch_queue_depth_messages{queue}`: messages waiting in each stage's broker queue."""

    def __init__(self, depth: Callable[[], dict[str, int]]) -> None:
        self.depth = depth

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "visbatch_queue_depth_messages", "Messages waiting in each queue.", labels=["queue"]
        )
        try:
            for queue, n in self.depth().items():
                family.add_metric([queue], n)
        except Exception as exc:  # a broker away: no sample rather than a failed scrape
            log.warning("queue depth unavailable: %s", exc)
        yield family


class JobStatesCollector(Collector):
    """`visbatch_jobs{status}`: jobs in each state, read from the database at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("visbatch_jobs", "Jobs in each state.", labels=["status"])
        try:
            for status, n in self.counts().items():
                family.add_metric([status], n)
        except Exception as exc:
            log.debug("job counts unavailable: %s", exc)
        yield family


# Ports a worker tries, from the one asked for: several workers on a host (one per GPU, an ingest
# worker beside them) each take the next free one instead of dying on EADDRINUSE.
PORT_SPAN = 32


def serve(
    port: int,
    *,
    host: str = "0.0.0.0",  # noqa: S104
    collectors: list[Collector] | None = None,
    span: int = 1,
) -> Any:
    """Expose /metrics on `port` (0: a free port), or on the next free one of `span` ports from
    it; returns the server (its `server_port`). OSError when none of them is free."""
    registry: CollectorRegistry = REGISTRY
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    for collector in collectors or []:
        registry.register(collector)
    candidates = [port] if port == 0 else list(range(port, min(port + max(1, span), 65536)))
    taken: OSError | None = None
    for candidate in candidates:
        try:
            server, _thread = start_http_server(candidate, addr=host, registry=registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            taken = exc
            continue
        # The one line that says where this process's metrics are (Prometheus' targets, tests).
        busy = f"{port}" if candidate == port + 1 else f"{port}-{candidate - 1}"
        moved = f"; {busy} in use" if candidate != port and port != 0 else ""
        log.info(
            "metrics on :%d (http://%s:%d/metrics%s)", server.server_port, host, server.server_port, moved
        )
        return server
    raise OSError(errno.EADDRINUSE, f"ports {candidates[0]}-{candidates[-1]} are all in use") from taken


def job_states(database_url: str) -> JobStatesCollector:
    from storage import repository as repo
    from storage.db import Database

    db = Database(database_url)
    return JobStatesCollector(lambda: repo.job_counts_by_status(db))
