"""PromptDataLoader: DataProto batches of prompts, epoch by epoch, resumable exactly.

Each epoch's order is a permutation drawn from a generator seeded by (seed, epoch) alone,
never from the state of a generator that earlier epochs advanced. So the loader's whole
state is (epoch, batches consumed in the epoch, seed): a run resumed from `state_dict()`
sees the same next batch as the run that saved it, across epoch boundaries too.

    loader = PromptDataLoader(dataset, batch_size=32)
    for epoch in range(loader.epoch, total_epochs):
        for batch in loader:          # one epoch, from where the loader stands
            ...
            checkpoint["dataloader"] = loader.state_dict()
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from hybridflow.protocol import DataProto
from hybridflow.validation import ConfigError


class PromptDataLoader:
    """Iterates a dataset with a `collate(rows) -> DataProto` method (e.g. RLHFDataset) in batches."""

    def __init__(
        self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(dataset) < batch_size:
            raise ConfigError(
                "data.train_batch_size",
                f"the dataset has {len(dataset)} rows (after dropping overlong prompts), fewer than one batch of "
                f"{batch_size}",
                "lower the batch size (data.train_batch_size) or add data",
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0  # the epoch the next batch comes from
        self.position = 0  # batches of that epoch already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        rows = len(self.dataset)
        return rows // self.batch_size if self.drop_last else math.ceil(rows / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch`: a function of (seed, epoch) only."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[DataProto]:
        """The rest of the current epoch; afterwards the loader stands at the next epoch's start."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self.order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            rows = [self.dataset[int(i)] for i in order[start : start + self.batch_size]]
            self.position += 1  # counted before the yield: a checkpoint taken now resumes after this batch
            yield self.dataset.collate(rows)
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands: the next batch is batch `position` of epoch `epoch`."""
        epoch, position = (self.epoch + 1, 0) if self.position >= len(self) else (self.epoch, self.position)
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved state; the data and batch size must be those of the saved run."""
        for key, mine in (("batch_size", self.batch_size), ("dataset_len", len(self.dataset))):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"cannot resume the data loader: the checkpoint has {key}={state[key]}, this run has {mine}; "
                    "resume with the same data files and batch size"
                )
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
