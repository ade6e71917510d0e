"""The tiers' plugin (tests/tiers.py) in a pytest run of its own: a test over the limit without the slow mark is
named at the end, a slow one or a quick one is not; a test of an end-to-end file marked neither slow nor smoke, or
marked both, fails before its fixtures run, with the rule."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]  # runs pytest within the test

TESTS = """
import time
import pytest

def test_quick():
    pass

def test_long_and_unmarked():
    time.sleep(0.6)

@pytest.mark.slow
def test_long_and_slow():
    time.sleep(0.6)

@pytest.fixture
def slow_to_build():
    time.sleep(0.6)

def test_long_in_its_fixture(slow_to_build):
    pass
"""


@pytest.fixture
def pytester(pytester):
    """A pytest run whose conftest registers the plugin with a 0.5 s limit, in this process or in its test processes
    (whose sys.path pytest-xdist sets: the conftest puts tests/ on it)."""
    tests = str(Path(__file__).parent)
    pytester.makeconftest(
        f"import sys\nsys.path.insert(0, {tests!r})\nfrom tiers import Tiers\n\n"
        "def pytest_configure(config):\n    config.pluginmanager.register(Tiers(0.5))\n"
    )
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--strict-markers", *args)


def test_a_long_test_without_the_slow_mark_is_named_at_the_end(pytester):
    pytester.makepyfile(test_units=TESTS)
    result = run(pytester)
    result.assert_outcomes(passed=4)
    section = result.stdout.str().split("tests over 0.5 s not marked slow", 1)[1]
    named = [line.split("s  ", 1)[1] for line in section.splitlines() if " s  test_" in line]
    assert sorted(named) == ["test_units.py::test_long_and_unmarked", "test_units.py::test_long_in_its_fixture"]
    assert all(float(line.split()[0]) >= 0.6 for line in section.splitlines() if " s  test_" in line)


def test_nothing_is_reported_when_every_long_test_is_slow(pytester):
    pytester.makepyfile(test_units=TESTS)
    result = run(pytester, "-k", "quick or slow")
    result.assert_outcomes(passed=2)
    assert "not marked slow" not in result.stdout.str()


def test_the_tiers_select_by_the_mark(pytester):
    pytester.makepyfile(test_units=TESTS)
    run(pytester, "-m", "slow").assert_outcomes(passed=1)
    run(pytester, "-m", "not slow").assert_outcomes(passed=3)


@pytest.mark.parametrize(
    "marks, error",
    [
        ("", "a test of an end-to-end file is marked slow (the slow tier) or smoke"),
        ("@pytest.mark.slow\n@pytest.mark.smoke\n", "is marked both slow and smoke"),
    ],
)
def test_an_end_to_end_test_outside_the_rule_fails_before_its_fixtures(pytester, marks, error):
    body = "@pytest.fixture\ndef whole_run():\n    raise AssertionError('set up')\n\n"
    pytester.makepyfile(test_run_e2e=f"import pytest\n\n{body}{marks}def test_a_whole_run(whole_run):\n    pass\n")
    result = run(pytester, "-p", "xdist", "-n", "1")  # as make test runs it: in a test process
    result.assert_outcomes(errors=1)
    output = result.stdout.str()
    assert error in output and "test_run_e2e.py::test_a_whole_run" in output and "set up" not in output


def test_an_end_to_end_test_in_a_tier_runs(pytester):
    pytester.makepyfile(
        test_run_e2e="import pytest\n\n@pytest.mark.smoke\ndef test_a():\n    pass\n\n"
        "@pytest.mark.slow\ndef test_b():\n    pass\n"
    )
    run(pytester).assert_outcomes(passed=2)
