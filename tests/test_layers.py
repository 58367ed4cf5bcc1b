"""The layout's import rules (docs/development.md, "Where things are"), read from every module's
imports (those inside functions too) with the ast module: nothing is imported or run.

Layers, from the bottom: visbatch.settings (imports nothing of the project) < storage <
ingest < worker's core (runtime, retry, metrics, errors, options, stages, engines, models,
tokens, planning) < the drivers (worker.drivers) < the command line (worker.cli) and the Python
API (visbatch.api), which sit side by side on the layers below them. And no import circle
anywhere (test_no_import_circle: the ones still to break are listed with their issue)."""

from __future__ import annotations

import ast
import subprocess
import sys
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
    assert len(MODULES) > 120 and "worker.drivers.fleet.tasks" in MODULES and "visbatch.settings" in MODULES


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
        "worker.runtime", "worker.retry", "worker.metrics", "worker.errors", "worker.job_options",
        "worker.results_export", "worker.stages", "worker.engines",
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


def test_tokens_sit_below_models():
    """What tokens need of a model (the cache key, the tower, positions) is a Protocol in tokens/,
    the adapter handed in; the requests built from them are the generate stage's (issue 33)."""
    forbidden = ("worker.models", "worker.engines", "worker.stages", "worker.runtime")
    assert _breaking("worker.tokens", forbidden=forbidden) == []


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


def _imports_typer(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "typer":
                return True
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "typer" for a in node.names):
            return True
    return False


def test_only_the_cli_imports_typer():
    """The command line is one package (issue 33): the job options and the errors a person is told
    are plain data below it, shared with the Python API, so that no other layer can print or exit."""
    importers = [
        _module_name(path)
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "versions" not in path.parts and _imports_typer(path)
    ]
    assert importers and all(_within(m, "worker.cli") for m in importers), importers


def test_import_visbatch_loads_no_command_line():
    """A notebook's `import visbatch` (and the API's job options and errors) pulls no typer, click
    or rich, and none of the command line's modules."""
    code = (
        "import sys, visbatch, visbatch.api, worker.job_options, worker.errors\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'click', 'rich')"
        " or m.startswith('worker.cli')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_stages_take_what_they_need_not_the_runtime():
    """A stage is handed the services it declares (worker.stages.needs), which the Runtime
    provides; it never imports the Runtime, so it cannot reach what it did not declare."""
    assert _breaking("worker.stages", forbidden=("worker.runtime",)) == []


# Circles still to break, each with the issue that breaks it. A circle found outside these fails
# the test below; one of these that is gone fails it too, so that the list only ever shrinks.
KNOWN_CIRCLES: dict[str, frozenset[str]] = {
    # None left (issue 33, item 4 broke the drivers' one: the stall watch is loaded with the tasks
    # at worker start, and the queue names live apart from the Celery app). A new circle fails.
}


def _circles() -> list[set[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    graph = {m: {n for n in imports if n in MODULES and n != m} for m, imports in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for name in sorted(graph[module]):
            if name not in index:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in on_stack:
                low[module] = min(low[module], index[name])
        if low[module] == index[module]:
            component = set()
            while True:
                name = stack.pop()
                on_stack.discard(name)
                component.add(name)
                if name == module:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circle():
    """No two modules of the project import each other, directly or around a circle. Every import
    counts, those inside functions and under TYPE_CHECKING too: a lazy import only hides a circle
    from the interpreter (the two modules still need each other, and which one may move down is
    no longer clear), as `storage.jobs` <-> `storage.results` and `ingest.anyres` <->
    `ingest.token_rules` were hidden until issue 33."""
    circles = _circles()
    unknown = [sorted(c) for c in circles if not any(c <= known for known in KNOWN_CIRCLES.values())]
    assert unknown == []
    gone = [issue for issue, known in KNOWN_CIRCLES.items() if not any(c <= known for c in circles)]
    assert gone == [], f"no longer a circle: remove it from KNOWN_CIRCLES ({gone})"
