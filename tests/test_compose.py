"""docker-compose.yml is valid Compose (no Docker engine here, so: the spec's JSON schema) and sane."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jsonschema
import yaml
from typer.main import get_command

from worker.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_matches_the_compose_specification():
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(_compose(), schema)


def test_rabbitmq_broker_and_an_evicting_cache_redis():
    services = _compose()["services"]
    cache = " ".join(services["redis-cache"]["command"])
    assert "allkeys-lru" in cache
    env = services["worker-cpu"]["environment"]
    assert env["VISBATCH_BROKER_URL"].startswith("amqp://") and "@rabbitmq:" in env["VISBATCH_BROKER_URL"]
    assert env["VISBATCH_CACHE_URL"].startswith("redis://redis-cache")


def test_prometheus_scrapes_every_worker():
    services = _compose()["services"]
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    workers = {name for name, svc in services.items() if "worker" in " ".join(svc.get("command", []))[:6]}
    assert workers == {"worker-cpu", "worker-gpu"}
    assert targets == {f"{name}:9808" for name in workers}
    assert all("9808" in services[name]["expose"] for name in workers)


def test_services_the_issue_asks_for():
    services = _compose()["services"]
    for name in (
        "postgres",
        "rabbitmq",
        "redis-cache",
        "minio",
        "createbuckets",
        "migrate",
        "worker-cpu",
        "worker-gpu",
        "watcher",
        "flower",
        "prometheus",
    ):
        assert name in services, name
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"


def test_commands_are_real_cli_commands():
    commands = set(get_command(app).list_commands(None))  # type: ignore[attr-defined]
    for name, service in _compose()["services"].items():
        if (
            service.get("image", "").startswith("visbatch")
            and "command" in service
            and "entrypoint" not in service
        ):
            assert service["command"][0] in commands, (name, service["command"])
