"""Keeps `make check`'s selection honest (issue 20): a test that starts a fleet of workers
(``tests.fleet_harness.Fleet``) without the ``fleet`` marker, or builds a fault of
``tests.faults`` without the ``faults`` marker, fails at once, saying which marker to add; it
would otherwise slip into the fast tier and slow it down. (Signals cannot be caught this way:
the ``signals`` marker is the author's to add.) Registered from the root conftest.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest

# module, class names, the marker a test that builds one must carry
GUARDED = [
    ("tests.fleet_harness", ["Fleet"], "fleet"),
    ("tests.faults", ["TCPProxy", "RedisServer", "FlakyS3Proxy", "PostgresCluster"], "faults"),
]


def _refuse(cls: type, marker: str, nodeid: str):
    def __init__(self, *args, **kwargs) -> None:
        raise pytest.UsageError(
            f"{nodeid} builds a {cls.__name__} without the '{marker}' marker: add "
            f"@pytest.mark.{marker} (or pytestmark = pytest.mark.{marker} for the whole module), "
            f"so that `make check` leaves it to `make test`"
        )

    return __init__


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    patched: list[tuple[type, object]] = []
    for module_name, class_names, marker in GUARDED:
        if item.get_closest_marker(marker) is not None:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a venv without the fleet's requirements
            continue
        for name in class_names:
            cls = getattr(module, name, None)
            init = getattr(cls, "__dict__", {}).get("__init__")
            if isinstance(cls, type) and init is not None:
                patched.append((cls, init))
                cls.__init__ = _refuse(cls, marker, item.nodeid)
    try:
        yield
    finally:
        for cls, init in patched:
            cls.__init__ = init
