"""Validation metrics from per-sample scores: mean score per data source and, with n > 1 samples per prompt,
mean@n and the unbiased pass@k of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1).

A sample is *correct* when its score is >= ``threshold`` (default 1.0, the score the built-in rule-based
scorers give a right answer; a tolerance of 1e-6 absorbs float noise). For a prompt with n samples of
which c are correct:

    pass@k = 1 - C(n - c, k) / C(n, k)   (the chance that k samples drawn without replacement hold a correct one)

computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which needs no large binomials. Per source, pass@k is
the mean over its prompts; k runs over 1, 2, 4, ... up to n, and n itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

TOLERANCE = 1e-6


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct (1 <= k <= n)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k samples holds a correct one
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def k_values(n: int) -> list[int]:
    """``8`` -> ``[1, 2, 4, 8]``; ``6`` -> ``[1, 2, 4, 6]``."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else ks + [n]


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[str],
    scores: Sequence[float],
    n: int,
    threshold: float = 1.0,
) -> dict[str, float]:
    """Metrics of one validation pass; one entry per generated sample in each sequence.

    ``uids``: the prompt each sample answers; the n samples of one prompt share it, and different prompts
    must not (make uids unique across validation batches). Returns ``val/<source>/score_mean`` and
    ``val/score/mean`` (means over all samples), and when n > 1 also ``val/<source>/mean@<n>`` (the mean
    over prompts of each prompt's mean score) and ``val/<source>/pass@<k>``.
    """
    if not len(data_sources) == len(uids) == len(scores):
        raise ValueError(f"lengths differ: {len(data_sources)} data_sources, {len(uids)} uids, {len(scores)} scores")
    if len(scores) == 0:
        return {}
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(data_sources, scores):
        by_source[str(source)].append(float(score))
    metrics = {f"val/{source}/score_mean": float(np.mean(values)) for source, values in by_source.items()}
    metrics["val/score/mean"] = float(np.mean(np.asarray(scores, dtype=float)))
    if n <= 1:
        return metrics

    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for source, uid, score in zip(data_sources, uids, scores):
        groups[(str(source), str(uid))].append(float(score))
    per_source: dict[str, list[list[float]]] = defaultdict(list)
    for (source, uid), values in groups.items():
        if len(values) != n:
            raise ValueError(
                f"prompt uid {uid!r} ({source}) has {len(values)} samples, expected n={n}: "
                "uids must be unique per prompt"
            )
        per_source[source].append(values)
    for source, prompts in per_source.items():
        table = np.asarray(prompts)  # (prompts, n)
        correct = (table >= threshold - TOLERANCE).sum(axis=1)  # (prompts,)
        metrics[f"val/{source}/mean@{n}"] = float(table.mean(axis=1).mean())
        for k in k_values(n):
            metrics[f"val/{source}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
    return metrics
