"""Reward-model training: the Bradley-Terry loss of each pair's scores (minus the pair's margin, ``pair_margin``),
averaged over the batch's pairs on all ranks; held out, the pairs' loss, accuracy and scores."""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import LossAggregation
from hybridflow.algorithms.objectives.base import (
    SEQUENCE_CLASSIFIER,
    SEQUENCE_SCORES,
    Columns,
    ForwardOutputs,
    Objective,
)
from hybridflow.algorithms.objectives.direct_preference import batch_pairs, pair_shares
from hybridflow.algorithms.preference import bradley_terry_loss, pair_halves, score_pair_metrics
from hybridflow.batch_keys import PAIR_MARGIN, SEQUENCE_SCORE

RM_LOSS = "rm/loss"  # the mean pair loss of a step


class BradleyTerry(Objective):
    name = "rm"
    output = SEQUENCE_SCORES
    model = SEQUENCE_CLASSIFIER
    paired = True
    share_keys = (RM_LOSS, "rm/accuracy", "rm/chosen_score", "rm/rejected_score", "rm/score_margin")
    shown = ((RM_LOSS, "loss"), ("rm/accuracy", "acc"), ("val/rm/accuracy", "val acc"))

    def loss(self, outputs: ForwardOutputs, batch: Columns, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        scores = outputs.scores
        chosen, rejected = pair_halves(scores)
        margin = pair_halves(batch[PAIR_MARGIN])[0].to(scores.device)
        pairs = batch_pairs(agg)
        loss = bradley_terry_loss(chosen, rejected, margin).sum() / pairs
        return loss, pair_shares(self.share_keys, loss, chosen.detach(), rejected.detach(), pairs)

    def held_out_rows(self, outputs: ForwardOutputs, batch: Columns) -> dict[str, torch.Tensor]:
        return {SEQUENCE_SCORE: outputs.scores, PAIR_MARGIN: batch[PAIR_MARGIN]}

    def held_out_metrics(self, rows: Columns) -> dict[str, float]:
        chosen, rejected = pair_halves(rows[SEQUENCE_SCORE])
        margin = pair_halves(rows[PAIR_MARGIN])[0]
        return {f"val/{key}": value for key, value in score_pair_metrics(chosen, rejected, margin).items()}
