"""The layout's import rules (docs/development.md, "Where things are"), read from every module's
imports (those inside functions too) with the ast module: nothing is imported or run.

Layers, from the bottom: visbatch.settings (imports nothing of the project) < storage <
ingest < worker's core (runtime, retry, metrics, errors, options, stages, engines, models,
tokens, planning) < the drivers (worker.drivers) < the command line (worker.cli) and the Python
API (visbatch.api), which sit side by side on the layers below them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("visbatch", "storage", "ingest", "worker", "migrations")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Project modules `path` imports: `from a.b import c` counts as a.b and a.b.c."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


MODULES = {
    _module_name(path): _imports(path)
    for package in PACKAGES
    for path in sorted((ROOT / package).rglob("*.py"))
    if "versions" not in path.parts  # migration scripts: history, frozen as written
}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _breaking(
    importer_prefix: str, allowed: tuple[str, ...] = (), forbidden: tuple[str, ...] = ()
) -> list[str]:
    out = []
    for module, imports in MODULES.items():
        if not _within(module, importer_prefix):
            continue
        for name in sorted(imports):
            if _within(name, importer_prefix):
                continue
            bad = (
                any(_within(name, f) for f in forbidden)
                if forbidden
                else not any(_within(name, a) for a in allowed)
            )
            if bad:
                out.append(f"{module} imports {name}")
    return out


def test_the_rules_see_the_whole_tree():
    assert len(MODULES) > 120 and "worker.drivers.tasks" in MODULES and "visbatch.settings" in MODULES


def test_settings_import_nothing_of_the_project():
    assert MODULES["visbatch.settings"] == set()


@pytest.mark.parametrize(
    ("layer", "allowed"),
    [
        ("storage", ("visbatch.settings",)),  # storage.db finds the migrations without importing them
        ("ingest", ("visbatch.settings", "storage")),
        ("migrations", ("visbatch.settings", "storage")),
    ],
)
def test_the_lower_layers_import_only_below_them(layer, allowed):
    assert _breaking(layer, allowed=allowed) == []


@pytest.mark.parametrize(
    "core",
    [
        "worker.runtime", "worker.retry", "worker.metrics", "worker.errors", "worker.options",
        "worker.budget_options", "worker.results_export", "worker.stages", "worker.engines",
        "worker.models", "worker.tokens", "worker.planning", "worker.review",
    ],
)  # fmt: skip
def test_the_core_knows_no_driver_no_cli_no_api(core):
    """A stage, an engine or a model runs the same under both drivers: it never reaches a driver
    (a Celery app), the command line or the Python API."""
    assert _breaking(core, forbidden=("worker.drivers", "worker.cli", "visbatch.api")) == []


def test_drivers_and_the_api_sit_below_the_cli():
    assert _breaking("worker.drivers", forbidden=("worker.cli", "visbatch.api")) == []
    assert _breaking("visbatch", forbidden=("worker.cli",)) == []


def test_models_know_no_engine_and_no_stage():
    assert _breaking("worker.models", forbidden=("worker.engines", "worker.stages", "worker.runtime")) == []


ENGINE_SHARED = ("worker.engines.base", "worker.engines.vllm_common", "worker.engines.structured")


def test_one_engine_per_file_and_no_sibling_imports():
    """As datatrove's inference servers: an engine imports the shared parts, never another engine."""
    engines = [
        m
        for m in MODULES
        if _within(m, "worker.engines") and m != "worker.engines" and m not in ENGINE_SHARED
    ]
    assert len(engines) >= 4
    crossing = [
        f"{m} imports {name}"
        for m in engines
        for name in MODULES[m]
        if _within(name, "worker.engines") and name != "worker.engines" and not _within(name, m)
        and not any(_within(name, s) for s in ENGINE_SHARED)
    ]  # fmt: skip
    assert crossing == []


def test_stages_take_what_they_need_not_the_runtime():
    """A stage is handed the services it declares (worker.stages.needs), which the Runtime
    provides; it never imports the Runtime, so it cannot reach what it did not declare."""
    assert _breaking("worker.stages", forbidden=("worker.runtime",)) == []
