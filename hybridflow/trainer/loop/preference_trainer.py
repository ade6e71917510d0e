"""The trainers on preference pairs: DPO (the ``dpo`` worker group) and the reward model (the ``rm`` group), one
optimizer step per batch of pairs.

    DPO:          pairs -> balance over ranks (a pair on one rank) -> the reference's log-probs -> train_batch
    reward model: pairs -> balance over ranks -> train_batch

The step loop (step_loop.py) runs them as it runs SFT and RL: the loader's resumable position, atomic verified
checkpoints in the actor's layout (``hybridflow export`` reads them), validation when due (the held-out pairs'
loss and accuracy: DPO's implicit rewards, the reward model's scores), the trackers, the progress display, the
timeline and the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from hybridflow.algorithms.preference import (
    PairOutput,
    PreferenceConfig,
    pair_halves,
    pair_metrics,
    preference_loss,
    score_pair_metrics,
)
from hybridflow.batch_keys import (
    ANSWER_LOG_PROB,
    ATTENTION_MASK,
    GLOBAL_STEP,
    METRICS,
    PAIR_MARGIN,
    REF_ANSWER_LOG_PROB,
    RESPONSE_MASK,
    SEQUENCE_SCORE,
)
from hybridflow.controller import RayWorkerGroup
from hybridflow.data import PromptDataLoader
from hybridflow.lengths import balanced_order, row_lengths
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.trainer.loop.step_loop import Metrics
from hybridflow.trainer.loop.supervised_trainer import SupervisedTrainer
from hybridflow.trainer.services.timeline import StepTimeline

DPO_SHOWN = (("dpo/loss", "loss"), ("dpo/reward_accuracy", "reward acc"), ("val/dpo/reward_accuracy", "val acc"))
RM_SHOWN = (("rm/loss", "loss"), ("rm/accuracy", "acc"), ("val/rm/accuracy", "val acc"))


def pair_order(batch: DataProto, dp_size: int) -> list[int]:
    """A permutation of the rows after which each data-parallel rank's contiguous share holds whole pairs, chosen
    first, and about as many tokens as the others. The pairs must divide over the ranks (pad a held-out batch
    first)."""
    if len(batch) % (2 * dp_size):
        raise ValueError(f"{len(batch) // 2} pairs do not divide over {dp_size} ranks: pad to whole pairs per rank")
    pairs = [row // 2 for row in range(len(batch))]
    return balanced_order(row_lengths(batch), dp_size, groups=pairs)


def pair_balanced(batch: DataProto, dp_size: int) -> DataProto:
    """``batch`` reordered by ``pair_order`` (in place)."""
    return batch.reorder(pair_order(batch, dp_size))


class PairTrainer(SupervisedTrainer):
    """What the trainers on preference pairs share: the pairs balanced whole over the ranks, the step's counts, and
    the held-out pairs' outputs in their order. A subclass gives ``train_pairs`` and ``held_out_metrics``."""

    def train_pairs(self, batch: DataProto, timeline: StepTimeline) -> Metrics:
        raise NotImplementedError

    def held_out_metrics(self, outputs: DataProto) -> Metrics:
        raise NotImplementedError

    def step(self, step: int, timeline: StepTimeline) -> Metrics | None:
        batch = next(self.batches, None)
        if batch is None:
            return None
        start = time.time()
        batch = pair_balanced(batch, self.dp_size)
        batch.meta_info[GLOBAL_STEP] = step
        metrics = self.train_pairs(batch, timeline)
        seconds = time.time() - start
        tokens = int(batch.batch[ATTENTION_MASK].sum())
        metrics.update(
            {
                "timing_s/step": seconds,
                "train/tokens": float(tokens),
                "train/trained_tokens": float(batch.batch[RESPONSE_MASK].sum()),
                "train/pairs": float(len(batch) // 2),
                "train/epoch": float(self.loader.state_dict()["epoch"]),
                "perf/tokens_per_second": tokens / seconds,
                "perf/driver_rss_gb": resident_gb(),
            }
        )
        return metrics

    def validate(self, step: int, timeline: StepTimeline) -> Metrics:
        """The held-out pairs' metrics (``held_out_metrics``) from the group's ``evaluate`` of every held-out
        batch, with the pairs' margins, in the batches' order."""
        outputs = []
        for batch in self.val_batches():
            padded, pad = batch.pad_to_divisor(2 * self.dp_size)  # copies of the first pairs: whole pairs
            order = pair_order(padded, self.dp_size)
            output = self.group.evaluate(padded.reorder(order))
            output.meta_info.pop(METRICS, None)
            output = output.reorder(np.argsort(order)).unpad(pad)  # the batch's order, without the copies
            output.batch[PAIR_MARGIN] = batch.batch[PAIR_MARGIN]
            outputs.append(output)
        return self.held_out_metrics(DataProto.concat(outputs))


class DPOTrainer(PairTrainer):
    """``preference``: the pair loss, for the held-out metrics (the workers have it for the update)."""

    shown = DPO_SHOWN

    def __init__(
        self,
        group: RayWorkerGroup,
        pool: str,
        dp_size: int,
        loader: PromptDataLoader,
        val_batches: Callable[[], Iterator[DataProto]] | None,
        preference: PreferenceConfig,
        *,
        total_epochs: int,
    ):
        super().__init__(group, pool, dp_size, loader, val_batches, total_epochs=total_epochs)
        self.preference = preference

    def train_pairs(self, batch: DataProto, timeline: StepTimeline) -> Metrics:
        with timeline.stage("ref"):
            reference = self.group.compute_ref_log_prob(batch)
        metrics = dict(reference.meta_info.pop(METRICS, {}))
        batch = batch.union(reference)
        with timeline.stage("train_batch"):
            output = self.group.train_batch(batch)
        metrics.update(output.meta_info.pop(METRICS, {}))
        return metrics

    def held_out_metrics(self, outputs: DataProto) -> Metrics:
        """The held-out pairs' mean loss, reward accuracy, chosen and rejected implicit rewards and margin."""
        scores: PairOutput = preference_loss(
            *pair_halves(outputs.batch[ANSWER_LOG_PROB]),
            *pair_halves(outputs.batch[REF_ANSWER_LOG_PROB]),
            self.preference,
        )
        return {f"val/{key}": value for key, value in pair_metrics(scores).items()}


class RewardModelTrainer(PairTrainer):
    """Bradley-Terry training of a reward model; held out: the pairs' loss (with their margins), accuracy and
    scores."""

    shown = RM_SHOWN

    def train_pairs(self, batch: DataProto, timeline: StepTimeline) -> Metrics:
        with timeline.stage("train_batch"):
            output = self.group.train_batch(batch)
        return dict(output.meta_info.pop(METRICS, {}))

    def held_out_metrics(self, outputs: DataProto) -> Metrics:
        chosen, rejected = pair_halves(outputs.batch[SEQUENCE_SCORE])
        margin = pair_halves(outputs.batch[PAIR_MARGIN])[0]
        return {f"val/{key}": value for key, value in score_pair_metrics(chosen, rejected, margin).items()}
