"""tests/tier_guard.py: a test that starts a fleet or builds a fault without its marker fails,
naming the marker; with it (on the test or its module) the real class is there, also right after
a refused one."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import pytest
from tests.faults import TCPProxy
from tests.fleet_harness import Fleet

def test_1_unmarked_fleet(tmp_path):
    Fleet(tmp_path)

@pytest.mark.fleet
def test_2_marked_fleet(tmp_path):
    with pytest.raises(TypeError):  # the real __init__, called with too few arguments
        Fleet(tmp_path)

def test_3_unmarked_proxy():
    TCPProxy()

@pytest.mark.faults
def test_4_marked_proxy():
    with pytest.raises(TypeError):
        TCPProxy()

def test_5_neither():
    pass
"""


def test_unmarked_fleet_and_fault_tests_fail_naming_their_marker(
    pytester: pytest.Pytester, monkeypatch
) -> None:
    # A subprocess: this very test runs under the guard too, which has the classes patched here.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini("[pytest]\nmarkers =\n    fleet: x\n    faults: x\n")
    pytester.makepyfile(test_tiers=TESTS)
    result = pytester.runpytest_subprocess(
        "-p", "tests.tier_guard", "-p", "no:hypothesispytest", "-p", "no:anyio"
    )
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines_random(
        [
            "*::test_1_unmarked_fleet builds a Fleet without the 'fleet' marker: add @pytest.mark.fleet *",
            "*test_tiers.py::test_3_unmarked_proxy builds a TCPProxy without the 'faults' marker*",
        ]
    )
