"""The critic's objective: the clipped value loss (value_loss.py) of each response token's value against its
return, the values before the update bounding the move (``cliprange_value``). Its rows are an RL step's, with the
critic's ``values`` and the estimator's ``returns``; like every RL objective, it has no held-out pass."""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import LossAggregation
from hybridflow.algorithms.objectives.base import TOKEN_CLASSIFIER, TOKEN_VALUES, Columns, ForwardOutputs, Objective
from hybridflow.algorithms.value_loss import compute_value_loss
from hybridflow.batch_keys import RESPONSE_MASK, RETURNS, VALUES

VF_LOSS = "critic/vf_loss"


class ClippedValue(Objective):
    """``settings``: the critic's section (``critic``: ``cliprange_value``)."""

    name = "value"
    output = TOKEN_VALUES
    model = TOKEN_CLASSIFIER
    share_keys = (VF_LOSS,)

    def loss(self, outputs: ForwardOutputs, batch: Columns, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        loss, metrics = compute_value_loss(
            outputs.values, batch[VALUES], batch[RETURNS], batch[RESPONSE_MASK], self.settings.cliprange_value, agg
        )
        return loss, {VF_LOSS: loss.detach(), **{f"critic/{k}": v for k, v in metrics.items()}}
