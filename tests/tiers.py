"""The suite's two tiers, as a pytest plugin that tests/conftest.py registers (tests/README.md has the rule).

A test that starts a whole system (a training run, the training service, vLLM's engine, the verifiers runner) is
marked ``slow`` and runs in ``make test-slow``; ``make test`` runs the rest, among them the ``smoke`` runs it keeps on
purpose. The plugin defines both marks, fails a test marked both and a test of an ``*_e2e.py`` file marked neither,
and ends a run by naming each test that took longer than ``slow_seconds`` (setup, call and teardown
together) without the ``slow`` mark: reported, not failed, since a loaded machine stretches every test.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

SLOW_SECONDS = 30.0
MARKS = {
    "slow": "starts a whole system (a training run, the training service, vLLM's engine, the verifiers runner): "
    "make test leaves it out, make test-slow runs it",
    "smoke": "a whole run that the fast tier keeps on purpose, so that a change that breaks the driver or a mode "
    "fails make test",
}


def tier_problem(item: pytest.Item) -> str | None:
    """What breaks the rule's two checkable parts: a test in both tiers, or a test of an end-to-end file in neither."""
    slow, smoke = item.get_closest_marker("slow"), item.get_closest_marker("smoke")
    if slow and smoke:
        return f"{item.nodeid} is marked both slow and smoke: a smoke run is in the fast tier (tests/README.md)"
    if item.nodeid.split("::", 1)[0].endswith("_e2e.py") and not (slow or smoke):
        return (
            f"{item.nodeid}: a test of an end-to-end file is marked slow (the slow tier) or smoke (one of the fast "
            "tier's whole runs); tests/README.md has the rule"
        )
    return None


class Tiers:
    """Each test's seconds and whether it is marked slow, from the reports that reach this process: under
    pytest-xdist the controller receives every test process's reports, and only it writes the summary."""

    def __init__(self, slow_seconds: float = SLOW_SECONDS):
        self.slow_seconds = slow_seconds
        self.seconds: dict[str, float] = defaultdict(float)
        self.marked_slow: set[str] = set()

    def pytest_configure(self, config: pytest.Config) -> None:
        for name, meaning in MARKS.items():
            config.addinivalue_line("markers", f"{name}: {meaning}")

    @pytest.hookimpl(tryfirst=True)  # before its fixtures are set up
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """A test outside the rule fails at its setup, with the rule (not at collection: under pytest-xdist the test
        processes collect, and an error raised there reaches the user as an internal error without its message)."""
        if problem := tier_problem(item):
            pytest.fail(problem, pytrace=False)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if "slow" in report.keywords:
            self.marked_slow.add(report.nodeid)

    def over_the_limit(self) -> list[tuple[float, str]]:
        """(seconds, node id) of each test over the limit without the slow mark, the longest first."""
        over = [(s, nodeid) for nodeid, s in self.seconds.items() if s > self.slow_seconds]
        return sorted(((s, nodeid) for s, nodeid in over if nodeid not in self.marked_slow), reverse=True)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not (over := self.over_the_limit()):
            return
        terminalreporter.section(f"tests over {self.slow_seconds:g} s not marked slow", yellow=True)
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
        terminalreporter.write_line(
            "Make each cheaper or, if it starts a whole system, mark it slow (tests/README.md)."
        )
