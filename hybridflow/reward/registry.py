"""Rule-based scorers, registered by the `data_source` of the rows they judge.

A scorer is a pure function of the decoded response:

    score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float | dict

A dict result has a `score` key (the reward) and any extras worth logging per sample
(`acc`, `pred`, ...). The reward manager picks the scorer with `get_scorer(data_source)`
for every sample; there is no other path, so a new task only needs a registered scorer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ScoreResult = float | dict[str, Any]
Scorer = Callable[..., ScoreResult]

_SCORERS: dict[str, Scorer] = {}
_FAMILIES: dict[str, Scorer] = {}  # "prefix" -> the scorer of every data source "prefix:<name>"


class UnknownDataSourceError(KeyError):
    """No scorer is registered for a data source (a KeyError whose message prints unquoted)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def register_scorer(*data_sources: str) -> Callable[[Scorer], Scorer]:
    """Decorator: register the function as the scorer of each named data source."""
    if not data_sources:
        raise ValueError("register_scorer needs at least one data_source name")

    def decorate(fn: Scorer) -> Scorer:
        for name in data_sources:
            if not isinstance(name, str) or not name:
                raise ValueError(f"a data_source name must be a non-empty string, got {name!r}")
            if name in _SCORERS and _SCORERS[name] is not fn:
                raise ValueError(f"a scorer for data_source {name!r} is already registered ({_SCORERS[name].__name__})")
            _SCORERS[name] = fn
        return fn

    return decorate


def register_scorer_family(prefix: str) -> Callable[[Scorer], Scorer]:
    """Decorator: register the function as the scorer of every data source ``"<prefix>:<name>"`` (a collection of
    tasks judged by one function, e.g. ``reasoning_gym:chain_sum``). An exact registration wins over a family."""
    if not isinstance(prefix, str) or not prefix or ":" in prefix:
        raise ValueError(f"a scorer family's prefix must be a non-empty string without ':', got {prefix!r}")

    def decorate(fn: Scorer) -> Scorer:
        if prefix in _FAMILIES and _FAMILIES[prefix] is not fn:
            raise ValueError(f"a scorer family {prefix!r} is already registered ({_FAMILIES[prefix].__name__})")
        _FAMILIES[prefix] = fn
        return fn

    return decorate


def get_scorer(data_source: str) -> Scorer:
    """The scorer registered for `data_source` (or for its family, ``prefix:name``); UnknownDataSourceError listing
    the known ones otherwise."""
    if isinstance(data_source, str) and data_source not in _SCORERS:
        prefix, sep, name = data_source.partition(":")
        if sep and name and prefix in _FAMILIES:
            return _FAMILIES[prefix]
    try:
        return _SCORERS[data_source]
    except (KeyError, TypeError):
        raise UnknownDataSourceError(
            f"no reward scorer registered for data_source {data_source!r}; known: {', '.join(list_scorers())}. "
            "Register one with @register_scorer, or set custom_reward_function.path / .name"
        ) from None


def list_scorers() -> list[str]:
    """Registered data sources, sorted (a family as ``prefix:<name>``)."""
    return sorted([*_SCORERS, *(f"{prefix}:<name>" for prefix in _FAMILIES)])
