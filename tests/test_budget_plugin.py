"""tests/budget_plugin.py: a test module over its time budget fails the run, saying which, how long
and what budget; a declared allowance (with its reason) lets it; session fixtures are not charged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SLEEPY = """
import time
{mark}

def test_one():
    time.sleep(0.25)

def test_two():
    time.sleep(0.25)
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeini("[pytest]\nmodule_budget_s = 0.3\n")
    # hypothesis's and anyio's plugins cost seconds per inner run on a busy machine; not needed here
    plugins = ["-p", "tests.budget_plugin", "-p", "no:hypothesispytest", "-p", "no:anyio"]
    return pytester.runpytest_inprocess(*plugins, *args)


def test_a_module_over_its_budget_fails_the_run_and_says_so(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delenv("VISBATCH_MODULE_BUDGET_S", raising=False)
    pytester.makepyfile(test_sleepy=SLEEPY.format(mark=""), test_quick="def test_quick():\n    pass\n")
    result = _run(pytester)
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*test modules over their time budget*", "test_sleepy.py took 0.5 s, over its budget of 0.3 s*"]
    )
    assert "test_quick.py took" not in result.stdout.str()


def test_durations_also_list_the_slowest_modules(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delenv("VISBATCH_MODULE_BUDGET_S", raising=False)
    pytester.makepyfile(test_quick="def test_quick():\n    pass\n")
    result = _run(pytester, "--durations=1")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        ["*slowest 10 test modules (own time / budget)*", "*0.? s / 0.3 s  test_quick.py"]
    )


def test_a_declared_budget_with_a_reason_allows_it(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delenv("VISBATCH_MODULE_BUDGET_S", raising=False)
    mark = "import pytest\npytestmark = pytest.mark.budget(5, reason='sleeps on purpose')"
    pytester.makepyfile(test_sleepy=SLEEPY.format(mark=mark))
    result = _run(pytester)
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
    assert "over their time budget" not in result.stdout.str()


def test_a_declared_budget_needs_a_reason(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delenv("VISBATCH_MODULE_BUDGET_S", raising=False)
    pytester.makepyfile(test_sleepy=SLEEPY.format(mark="import pytest\npytestmark = pytest.mark.budget(5)"))
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_sleepy.py: write pytest.mark.budget(SECONDS, reason=*"])


def test_the_environment_overrides_the_budget_and_0_turns_it_off(
    pytester: pytest.Pytester, monkeypatch
) -> None:
    pytester.makepyfile(test_sleepy=SLEEPY.format(mark=""))
    monkeypatch.setenv("VISBATCH_MODULE_BUDGET_S", "5")
    assert _run(pytester).ret == pytest.ExitCode.OK
    monkeypatch.setenv("VISBATCH_MODULE_BUDGET_S", "0")
    assert _run(pytester).ret == pytest.ExitCode.OK
    monkeypatch.setenv("VISBATCH_MODULE_BUDGET_S", "0.3")
    assert _run(pytester).ret == pytest.ExitCode.TESTS_FAILED


def test_a_failing_run_stays_failed_and_session_fixtures_are_not_charged(
    pytester: pytest.Pytester, monkeypatch
) -> None:
    """A session fixture's setup (a service, the tiny model) is paid once per run by whichever
    module comes first: it is not that module's time."""
    monkeypatch.delenv("VISBATCH_MODULE_BUDGET_S", raising=False)
    pytester.makeconftest(
        "import time, pytest\n\n@pytest.fixture(scope='session')\ndef service():\n    time.sleep(0.6)\n"
    )
    pytester.makepyfile(
        test_first="def test_uses_it(service):\n    pass\n",
        test_broken="def test_broken():\n    assert False\n",
    )
    result = _run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "over their time budget" not in result.stdout.str()


def test_under_xdist_the_controller_judges_and_session_fixtures_are_not_charged(
    pytester: pytest.Pytester, monkeypatch
) -> None:
    """`make test` runs the suite over xdist workers: the modules' times are summed from the
    workers' reports, a session fixture set up in a worker is still not charged, and a module
    over its budget fails the run once, by the controller."""
    monkeypatch.delenv("VISBATCH_MODULE_BUDGET_S", raising=False)
    pytester.makeconftest(
        "import time, pytest\n\n@pytest.fixture(scope='session')\ndef service():\n    time.sleep(0.6)\n"
    )
    allowed = "import pytest\npytestmark = pytest.mark.budget(5, reason='sleeps on purpose')"
    pytester.makepyfile(
        test_first="def test_uses_it(service):\n    pass\n",
        test_sleepy=SLEEPY.format(mark=""),
        test_allowed=SLEEPY.format(mark=allowed),
    )
    pytester.makeini("[pytest]\nmodule_budget_s = 0.3\n")
    root = str(Path(__file__).resolve().parents[1])  # the subprocess imports tests.budget_plugin from here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess(
        "-p", "tests.budget_plugin", "-p", "no:hypothesispytest", "-p", "no:anyio",
        "-n", "2", "--dist", "loadfile", "--durations=1",
    )  # fmt: skip
    result.assert_outcomes(passed=5)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert out.count("test_sleepy.py took 0.5 s, over its budget of 0.3 s") == 1, out
    assert "test_first.py took" not in out
    assert "test_allowed.py took" not in out  # its declared budget reached the controller
    result.stdout.fnmatch_lines(["*slowest 10 test modules*", "*test_sleepy.py"])


def test_the_modules_allowed_the_longest_run_first(pytester: pytest.Pytester, monkeypatch) -> None:
    """Longest first, so that over xdist workers (`make test`) a long module is never the last
    one started; each module's tests stay together and in their order."""
    monkeypatch.delenv("VISBATCH_MODULE_BUDGET_S", raising=False)
    long = "import pytest\npytestmark = pytest.mark.budget({s}, reason='long')\n"
    pytester.makepyfile(
        test_a="def test_a1():\n    pass\n\ndef test_a2():\n    pass\n",
        test_b=long.format(s=50) + "\ndef test_b1():\n    pass\n",
        test_c=long.format(s=200) + "\ndef test_c1():\n    pass\n\ndef test_c2():\n    pass\n",
    )
    result = _run(pytester, "--collect-only", "-q")
    names = [line.split("::")[1] for line in result.stdout.lines if "::" in line]
    assert names == ["test_c1", "test_c2", "test_b1", "test_a1", "test_a2"]
