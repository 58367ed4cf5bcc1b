"""A time budget per test module, so that the suite's time cannot quietly rot (issue 20).

Each module's tests are timed in all (setup + call + teardown, as pytest's reports say, less the
setup of session-scoped fixtures: the services and the tiny model are paid for once per run, by
whichever module happens to come first). When a module took longer than its budget, the run
fails after the last test, with a line naming the module, its time and its budget.

The budget is ``module_budget_s`` (ini option, default 90 s; the environment variable
``VISBATCH_MODULE_BUDGET_S`` overrides it, and 0 turns the guard off, e.g. when stepping through
a test). A module that may take longer says so, and why, in its ``pytestmark``::

    pytestmark = pytest.mark.budget(240, reason="a fleet per fault; to share one fleet (issue 20)")

A module run only in part is held to the same budget (it can only be under). Under ``--pdb`` the
guard is off. With ``--durations`` the 10 slowest modules are listed too, with their budgets.
Registered from the root conftest.py.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

DEFAULT_BUDGET_S = 90.0
ENV = "VISBATCH_MODULE_BUDGET_S"
SESSION_SETUP = "visbatch_session_fixture_setup_s"
ALLOWED = "visbatch_module_budget"  # (seconds, reason) of a module's pytest.mark.budget


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "module_budget_s",
        f"seconds one test module may take in all unless it declares pytest.mark.budget "
        f"(default {DEFAULT_BUDGET_S:g}; {ENV} overrides; 0: no guard)",
        default=str(DEFAULT_BUDGET_S),
    )


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class ModuleBudget:
    def __init__(self, default_s: float) -> None:
        self.default_s = default_s
        self.spent: defaultdict[str, float] = defaultdict(float)
        self.session_setup: defaultdict[str, float] = defaultdict(float)
        self.allowed: dict[str, tuple[float, str]] = {}
        self.current: str | None = None
        self.pending_session_setup = 0.0
        self.over: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            module = item.getparent(pytest.Module)
            if module is None or module.nodeid in self.allowed:
                continue
            marker = module.get_closest_marker("budget")
            if marker is None:
                continue
            seconds = marker.args[0] if marker.args else marker.kwargs.get("seconds")
            reason = marker.kwargs.get("reason") or (marker.args[1] if len(marker.args) > 1 else "")
            if not isinstance(seconds, int | float) or seconds <= 0 or not str(reason).strip():
                raise pytest.UsageError(
                    f"{module.nodeid}: write pytest.mark.budget(SECONDS, reason='why it may take that long')"
                )
            self.allowed[module.nodeid] = (float(seconds), str(reason))
        # The modules allowed the longest run first (a stable sort keeps each module's tests
        # together and in order): over xdist workers (`--dist loadfile --no-loadscope-reorder`,
        # as make test runs it), the longest jobs handed out first end the run together, rather
        # than one long module started last running on alone.
        items.sort(key=lambda item: -self.budget_of(_module_of(item.nodeid)))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item):
        self.current = _module_of(item.nodeid)
        yield
        self.current = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef):
        started = time.perf_counter()
        yield
        if fixturedef.scope == "session" and self.current is not None:
            self.pending_session_setup += time.perf_counter() - started

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        # The session fixtures' time rides on the setup report, so that it is subtracted where the
        # reports are summed: in this process, or in xdist's controller (which sets up no fixture).
        outcome = yield
        if call.when != "setup":
            return
        report = outcome.get_result()
        if self.pending_session_setup:
            report.user_properties.append((SESSION_SETUP, self.pending_session_setup))
            self.pending_session_setup = 0.0
        module = _module_of(item.nodeid)
        if module in self.allowed:  # xdist's controller collects nothing: it learns budgets here
            report.user_properties.append((ALLOWED, self.allowed[module]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = _module_of(report.nodeid)
        self.spent[module] += report.duration
        for name, value in report.user_properties:
            if name == SESSION_SETUP:
                self.session_setup[module] += float(value)
            elif name == ALLOWED:
                seconds, reason = value
                self.allowed[module] = (float(seconds), str(reason))

    def budget_of(self, module: str) -> float:
        return self.allowed.get(module, (self.default_s, ""))[0]

    def own_time(self, module: str) -> float:
        return self.spent[module] - self.session_setup.get(module, 0.0)

    def check(self) -> list[str]:
        over = []
        for module in sorted(self.spent):
            own = self.own_time(module)
            budget = self.budget_of(module)
            if own > budget:
                how = "its pytest.mark.budget" if module in self.allowed else "the default module_budget_s"
                over.append(
                    f"{module} took {own:.1f} s, over its budget of {budget:g} s ({how}): make it "
                    f"cheaper, or declare pytestmark = pytest.mark.budget(SECONDS, reason=...) saying why"
                )
        return over

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):
            return  # an xdist worker: the controller, which sees every module's reports, judges
        self.over = self.check()
        if self.over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, config: pytest.Config) -> None:
        if config.getoption("durations", None) is not None and self.spent:  # beside --durations
            terminalreporter.section("slowest 10 test modules (own time / budget)")
            for module in sorted(self.spent, key=self.own_time, reverse=True)[:10]:
                own, budget = self.own_time(module), self.budget_of(module)
                terminalreporter.line(f"{own:8.1f} s / {budget:g} s  {module}")
        if self.over:
            terminalreporter.section("test modules over their time budget", red=True, bold=True)
            for line in self.over:
                terminalreporter.line(line, red=True)


def pytest_configure(config: pytest.Config) -> None:
    raw = os.environ.get(ENV) or config.getini("module_budget_s")
    try:
        default_s = float(raw)
    except ValueError:
        raise pytest.UsageError(f"module_budget_s / {ENV} must be a number of seconds, not {raw!r}") from None
    if default_s <= 0 or config.getoption("usepdb", False):
        return
    config.pluginmanager.register(ModuleBudget(default_s), "visbatch-module-budget")
