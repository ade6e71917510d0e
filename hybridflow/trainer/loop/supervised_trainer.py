"""The supervised trainer (``hybridflow sft``, ``dpo``, ``rm``, and any registered objective): batches of labelled
rows to one worker group on one pool, one optimizer step each.

    rows -> balance over ranks (a pair whole on one rank) -> [the reference's log-probs] -> train_batch -> metrics

The objective (algorithms/objectives/) says whether rows come in pairs and need a reference pass, and forms the
held-out metrics from the workers' per-row measures. The step loop (step_loop.py) runs it as it runs RL: the
loader's resumable position, atomic verified checkpoints in the actor's layout (``hybridflow export`` reads them),
validation when due, the trackers, the progress display (``shown``), the timeline and the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from hybridflow.algorithms.objectives import Objective
from hybridflow.batch_keys import ATTENTION_MASK, GLOBAL_STEP, METRICS, RESPONSE_MASK
from hybridflow.controller import RayWorkerGroup
from hybridflow.data import PromptDataLoader
from hybridflow.lengths import balanced_order, row_lengths
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.trainer.loop.batch_source import train_batches
from hybridflow.trainer.loop.step_loop import CheckpointParts, Metrics
from hybridflow.trainer.services.timeline import StepTimeline


def unit_order(batch: DataProto, dp_size: int, unit: int) -> list[int]:
    """A permutation of the rows after which each data-parallel rank's contiguous share holds whole units of ``unit``
    consecutive rows (a pair: 2, chosen first) and about as many tokens as the others. Pairs must divide over the
    ranks (pad a held-out batch first)."""
    if unit > 1 and len(batch) % (unit * dp_size):
        raise ValueError(f"{len(batch) // unit} pairs do not divide over {dp_size} ranks: pad to whole pairs per rank")
    return balanced_order(row_lengths(batch), dp_size, groups=[row // unit for row in range(len(batch))])


class SupervisedTrainer:
    """``group``: the worker group (workers/supervised.py); ``pool``: its pool's name, its lane in the timeline;
    ``dp_size``: the data-parallel ranks the rows split over; ``val_batches``: the held-out batches (None: none)."""

    def __init__(
        self,
        objective: Objective,
        group: RayWorkerGroup,
        pool: str,
        dp_size: int,
        loader: PromptDataLoader,
        val_batches: Callable[[], Iterator[DataProto]] | None,
        *,
        total_epochs: int,
    ):
        self.objective = objective
        self.shown = objective.shown
        self.unit = 2 if objective.paired else 1
        self.group = group
        self.pool = pool
        self.dp_size = dp_size
        self.loader = loader
        self.val_batches = val_batches
        self.batches = train_batches(loader, total_epochs)

    def begin(self, step: int, timeline: StepTimeline) -> None:
        pass

    def step(self, step: int, timeline: StepTimeline) -> Metrics | None:
        batch = next(self.batches, None)
        if batch is None:
            return None
        start = time.time()
        batch = batch.reorder(unit_order(batch, self.dp_size, self.unit))
        batch.meta_info[GLOBAL_STEP] = step
        metrics: Metrics = {}
        if self.objective.reference:
            with timeline.stage("ref"):
                reference = self.group.compute_ref_log_prob(batch)
            metrics.update(reference.meta_info.pop(METRICS, {}))
            batch = batch.union(reference)
        with timeline.stage("train_batch"):
            output = self.group.train_batch(batch)
        metrics.update(output.meta_info.pop(METRICS, {}))
        seconds = time.time() - start
        tokens = int(batch.batch[ATTENTION_MASK].sum())
        metrics.update(
            {
                "timing_s/step": seconds,
                "train/tokens": float(tokens),
                "train/trained_tokens": float(batch.batch[RESPONSE_MASK].sum()),
                f"train/{self.loader.dataset.unit}": float(len(batch) // self.unit),
                "train/epoch": float(self.loader.state_dict()["epoch"]),
                "perf/tokens_per_second": tokens / seconds,
                "perf/driver_rss_gb": resident_gb(),
            }
        )
        return metrics

    def validate(self, step: int, timeline: StepTimeline) -> Metrics:
        """The objective's held-out metrics from the group's measures of every held-out row, in the batches' order."""
        outputs = []
        for batch in self.val_batches():
            padded, pad = batch.pad_to_divisor(self.unit * self.dp_size)  # copies of the first rows: whole units
            order = unit_order(padded, self.dp_size, self.unit)  # every rank runs as many passes
            output = self.group.evaluate(padded.reorder(order))
            output.meta_info.pop(METRICS, None)
            outputs.append(output.reorder(np.argsort(order)).unpad(pad))  # the batch's order, without the copies
        return self.objective.held_out_metrics(DataProto.concat(outputs).batch)

    def checkpoint(self, step: int) -> CheckpointParts:
        group = self.group
        return CheckpointParts(
            state={"data_loader": self.loader.state_dict()},
            write=lambda directory: group.save_checkpoint(str(directory)),
        )

    def restore(self, checkpoint: Path, state: dict) -> None:
        self.group.load_checkpoint(str(checkpoint))
        self.loader.load_state_dict(state["data_loader"])

    def collect_spans(self, timeline: StepTimeline) -> None:
        timeline.collect_group(self.pool, self.group)

    def end(self, failed: bool) -> None:
        pass  # nothing runs in the background
