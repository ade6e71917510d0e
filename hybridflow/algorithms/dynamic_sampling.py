"""DAPO's dynamic sampling (Yu et al. 2025, §3.2), `algorithm.filter_groups.*`: pure selection rules.

A group (the samples of one prompt) whose training rewards are all equal has zero advantage under
every group-relative estimator: it adds no gradient, only noise to the batch statistics. The
driver drops such groups and generates for more prompts until the batch holds `train_batch_size`
informative groups. After `max_num_gen_batches` rounds it stops and fills the batch with dropped
groups (so the step still runs on a full batch; `dynamic_sampling/filler_groups` counts them).
verl raises an error at the cap instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridflow.validation import require


@dataclass(kw_only=True)
class FilterGroupsConfig:
    """Dynamic sampling: train only on groups whose rewards differ, generating more to fill the batch."""

    enable: bool  # drop groups whose training rewards are all equal and generate more until the batch is full
    max_num_gen_batches: int  # generation rounds a step may use (the first included; 0: no cap)

    def __post_init__(self) -> None:
        require(self.max_num_gen_batches >= 0, "max_num_gen_batches", f"must be >= 0, got {self.max_num_gen_batches}")

    def may_generate(self, rounds_done: int) -> bool:
        """Whether another generation round is allowed after ``rounds_done`` rounds."""
        return self.max_num_gen_batches == 0 or rounds_done < self.max_num_gen_batches


def informative_groups(uids: np.ndarray, sequence_rewards: torch.Tensor) -> dict[str, bool]:
    """Group id -> whether its samples' rewards (B,) are not all equal (a single sample is never informative)."""
    rewards = sequence_rewards.detach().double().cpu()
    by_group: dict[str, list[float]] = {}
    for uid, reward in zip(uids, rewards.tolist()):
        by_group.setdefault(str(uid), []).append(reward)
    return {uid: max(values) > min(values) for uid, values in by_group.items()}


def select_groups(kept: list[str], dropped: list[str], n_groups: int) -> tuple[list[str], int]:
    """The ``n_groups`` groups a step trains on: informative ones first (in order), then dropped ones
    as filler when there are too few. Returns (group ids, number of filler groups)."""
    chosen = kept[:n_groups]
    filler = dropped[: n_groups - len(chosen)]
    return chosen + filler, len(filler)


def rows_of_groups(uids: np.ndarray, groups: list[str]) -> list[int]:
    """Indices of the rows belonging to ``groups``, group by group in that order, rows in batch order."""
    rows_by_group: dict[str, list[int]] = {}
    for row, uid in enumerate(uids):
        rows_by_group.setdefault(str(uid), []).append(row)
    return [row for group in groups for row in rows_by_group[group]]
