"""Supervised fine-tuning: the negative log-likelihood of the trained tokens (``response_mask``), averaged over every
trained token of the batch on all ranks; held out, the loss per trained token and its perplexity."""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.aggregation import LossAggregation, agg_loss
from hybridflow.algorithms.objectives.base import Columns, ForwardOutputs, Objective
from hybridflow.batch_keys import LOSS_TOKENS, NLL_SUM, RESPONSE_MASK, SFT_LOSS

VAL_LOSS = "val/loss"  # mean negative log-likelihood per trained held-out token
VAL_PERPLEXITY = "val/perplexity"  # exp(val/loss)


class NegativeLogLikelihood(Objective):
    name = "sft"
    share_keys = (SFT_LOSS,)
    shown = ((SFT_LOSS, "loss"), (VAL_LOSS, "val loss"))

    def loss(self, outputs: ForwardOutputs, batch: Columns, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        loss = agg_loss(-outputs.log_probs, batch[RESPONSE_MASK], agg)
        return loss, {SFT_LOSS: loss.detach()}

    def held_out_rows(self, outputs: ForwardOutputs, batch: Columns) -> dict[str, torch.Tensor]:
        mask = batch[RESPONSE_MASK].float()
        return {NLL_SUM: -(outputs.log_probs * mask).sum(dim=1), LOSS_TOKENS: mask.sum(dim=1)}

    def held_out_metrics(self, rows: Columns) -> dict[str, float]:
        tokens = float(rows[LOSS_TOKENS].double().sum())
        loss = float(rows[NLL_SUM].double().sum()) / max(tokens, 1.0)
        return {VAL_LOSS: loss, VAL_PERPLEXITY: math.exp(min(loss, 80.0)), "val/tokens": tokens}
