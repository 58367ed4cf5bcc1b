"""Prometheus metrics: scraped from live workers during a fleet job, and from an embedded run."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.faults import free_port
from tests.fleet_harness import Fleet
from tests.media import write_pdf

pytestmark = pytest.mark.slow


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a live /metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:  # noqa: S310
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab))


def test_metric_names_follow_prometheus_conventions():
    from prometheus_client.registry import REGISTRY

    from worker import metrics  # noqa: F401 - registers the metrics

    families = [f for f in REGISTRY.collect() if f.name.startswith("visbatch_")]
    assert len(families) >= 10
    for family in families:
        for sample in family.samples:
            if family.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name
        if "seconds" in family.name or "duration" in family.name:
            assert "_seconds" in family.name, family.name


def _wait_for(condition, fleet: Fleet, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.2)


@pytest.mark.fleet
def test_live_workers_expose_moving_counters(tmp_path, tiny_model_dir, postgres_url, redis_url):
    fleet = Fleet(tmp_path, tiny_model_dir, postgres_url)
    try:
        cpu_port, gpu_port = free_port(), free_port()
        fleet.start_worker("ingest", "--metrics-port", str(cpu_port))
        fleet.start_worker("encode,generate", "--metrics-port", str(gpu_port))
        _wait_for(lambda: _ports_up(cpu_port, gpu_port), fleet)
        before = _scrape(gpu_port)
        pdf = write_pdf(tmp_path / "doc.pdf", pages=4)
        job = fleet.submit(str(pdf), "-p", "What is this?", "-p", "Any table?", "--max-new-tokens", "8")
        fleet.wait([job])
        assert fleet.status(job) == "succeeded", fleet.logs()
        cpu, gpu = _scrape(cpu_port), _scrape(gpu_port)
        # The ingest worker's pool processes stored the pages; the GPU worker encoded and answered.
        assert _value(cpu, "visbatch_units_total", stage="ingest", outcome="ok") == 4
        assert _value(gpu, "visbatch_units_total", stage="encode", outcome="ok") == 4
        assert (
            _value(gpu, "visbatch_results_total", outcome="ok")
            - _value(before, "visbatch_results_total", outcome="ok")
            == 8
        )
        assert _value(gpu, "visbatch_tokens_total", kind="completion") > 0
        assert _value(gpu, "visbatch_engine_busy_seconds_total") > 0
        assert _value(gpu, "visbatch_tower_images_total") == 4
        assert _value(gpu, "visbatch_cache_lookups_total", result="miss") >= 4
        assert ("visbatch_requests_in_flight", ()) in gpu
        # Read at scrape time: the broker's queues and the jobs' states.
        assert {lab for (n, lab) in gpu if n == "visbatch_queue_depth_messages"} == {
            (("queue", "ingest"),),
            (("queue", "encode"),),
            (("queue", "generate"),),
        }
        assert _value(gpu, "visbatch_jobs", status="succeeded") >= 1
    finally:
        fleet.close()


def _ports_up(*ports: int) -> bool:
    try:
        for port in ports:
            _scrape(port)
    except OSError:
        return False
    return True


def test_an_embedded_run_serves_metrics(settings_factory, tmp_path):
    from ingest.spec import JobSpec, Sampling
    from worker import metrics
    from worker.drivers.embedded import EmbeddedRun
    from worker.runtime import Runtime

    rt = Runtime(settings_factory())
    run = EmbeddedRun(rt)
    server = metrics.serve(0, host="127.0.0.1", collectors=[metrics.QueueDepthCollector(run.queue_depths)])
    try:
        before = _scrape(server.server_port)
        pdf = write_pdf(tmp_path / "doc.pdf", pages=2)
        run.run([pdf], JobSpec(prompts=["Hi"], sampling=Sampling(max_new_tokens=4)))
        after = _scrape(server.server_port)
        assert _value(after, "visbatch_results_total") - _value(before, "visbatch_results_total") == 2
        assert _value(after, "visbatch_stage_busy_seconds_total", stage="ingest") > _value(
            before, "visbatch_stage_busy_seconds_total", stage="ingest"
        )
    finally:
        server.shutdown()
        rt.close()
