"""Reading a run's ``metrics.jsonl`` into one series per metric."""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Series:
    """One metric over the run: ``steps`` (S,) ascending ints and ``values`` (S,) floats."""

    steps: np.ndarray
    values: np.ndarray

    def at(self, step: int) -> float | None:
        hits = np.nonzero(self.steps == step)[0]
        return float(self.values[hits[0]]) if len(hits) else None


Metrics = dict[str, Series]


def load_metrics(path: Path) -> Metrics:
    """Series of every finite numeric metric in a jsonl file (one object per line with a ``step`` key).

    A step logged twice (a resumed run re-runs the steps after its checkpoint) keeps its last values;
    lines that do not parse (a run killed mid-write) are skipped.
    """
    by_key: dict[str, dict[int, float]] = {}
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        for key, value in row.items():
            if (
                key == "step"
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                continue
            by_key.setdefault(key, {})[step] = float(value)
    metrics = {}
    for key, points in by_key.items():
        steps = np.array(sorted(points), dtype=np.int64)
        metrics[key] = Series(steps, np.array([points[s] for s in steps], dtype=np.float64))
    return metrics


def match(metrics: Metrics, patterns: tuple[str, ...]) -> list[str]:
    """Metric names matching any pattern (``*`` wildcards), in pattern order, each once."""
    names: list[str] = []
    for pattern in patterns:
        found = (
            sorted(k for k in metrics if fnmatch.fnmatchcase(k, pattern))
            if "*" in pattern
            else [pattern] * (pattern in metrics)
        )
        names.extend(k for k in found if k not in names)
    return names
