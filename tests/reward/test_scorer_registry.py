"""The scorer registry: lookup, unknown sources, duplicates."""

import pytest

from hybridflow.reward import UnknownDataSourceError, get_scorer, list_scorers, register_scorer


def test_builtins_are_registered():
    assert {"arithmetic", "countdown", "gsm8k", "openai/gsm8k", "math", "lighteval/MATH"} <= set(list_scorers())


def test_unknown_source_lists_the_known_ones():
    with pytest.raises(UnknownDataSourceError) as error:
        get_scorer("no_such_task")
    message = str(error.value)
    assert "'no_such_task'" in message and "arithmetic, calculator, countdown" in message
    assert isinstance(error.value, KeyError)


def test_register_and_duplicate():
    @register_scorer("test_registry_a", "test_registry_b")
    def always_one(solution_str, ground_truth, extra_info=None):
        return 1.0

    assert get_scorer("test_registry_a") is always_one and get_scorer("test_registry_b") is always_one
    with pytest.raises(ValueError, match="already registered"):
        register_scorer("test_registry_a")(lambda s, g, e=None: 0.0)
    with pytest.raises(ValueError):
        register_scorer()


def test_a_family_scores_every_source_of_its_prefix_and_an_exact_name_wins():
    from hybridflow.reward import register_scorer_family

    @register_scorer_family("test_family")
    def family(solution_str, ground_truth, extra_info=None):
        return 0.5

    @register_scorer("test_family:special")
    def special(solution_str, ground_truth, extra_info=None):
        return 1.0

    assert get_scorer("test_family:a") is family and get_scorer("test_family:b:c") is family
    assert get_scorer("test_family:special") is special
    assert "test_family:<name>" in list_scorers() and "reasoning_gym:<name>" in list_scorers()
    for unknown in ("test_family", "test_family:", "other:a"):
        with pytest.raises(UnknownDataSourceError):
            get_scorer(unknown)
    with pytest.raises(ValueError, match="already registered"):
        register_scorer_family("test_family")(lambda s, g, e=None: 0.0)
    with pytest.raises(ValueError, match="without ':'"):
        register_scorer_family("a:b")
