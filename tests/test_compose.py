"""docker-compose.yml is valid Compose (no Docker engine here, so: the spec's JSON schema) and sane."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jsonschema
import yaml

from worker.cli import app

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_matches_the_compose_specification():
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(_compose(), schema)


def test_two_redis_instances_with_the_right_eviction():
    services = _compose()["services"]
    broker = " ".join(services["redis-broker"]["command"])
    cache = " ".join(services["redis-cache"]["command"])
    assert "noeviction" in broker and "allkeys-lru" in cache
    env = services["worker-cpu"]["environment"]
    assert env["VISBATCH_BROKER_URL"] != env["VISBATCH_CACHE_URL"]


def test_services_the_issue_asks_for():
    services = _compose()["services"]
    for name in (
        "postgres",
        "redis-broker",
        "redis-cache",
        "minio",
        "createbuckets",
        "migrate",
        "worker-cpu",
        "worker-gpu",
        "watcher",
        "flower",
    ):
        assert name in services, name
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"


def test_commands_are_real_cli_commands():
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    commands |= {g.name for g in app.registered_groups}
    for name, service in _compose()["services"].items():
        if (
            service.get("image", "").startswith("visbatch")
            and "command" in service
            and "entrypoint" not in service
        ):
            assert service["command"][0] in commands, (name, service["command"])
