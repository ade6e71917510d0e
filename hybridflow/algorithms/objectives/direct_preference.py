"""Direct preference optimisation (DPO, IPO, hinge: ``algorithms/preference.py``): each pair's loss from its two
answers' log-probs under the trained model and the reference, averaged over the batch's pairs on all ranks; held
out, the pairs' loss, reward accuracy, implicit rewards and margin."""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import LossAggregation
from hybridflow.algorithms.objectives.base import Columns, ForwardOutputs, Objective
from hybridflow.algorithms.preference import (
    PREFERENCE_LOSSES,
    PreferenceConfig,
    answer_log_probs,
    pair_halves,
    pair_metrics,
    preference_loss,
)
from hybridflow.batch_keys import ANSWER_LOG_PROB, REF_ANSWER_LOG_PROB, REF_LOG_PROB, RESPONSE_MASK

DPO_LOSS = "dpo/loss"  # the mean pair loss of a step


def batch_pairs(agg: LossAggregation) -> float:
    """The batch's pairs on all ranks: every answer has trained tokens, so its rows / 2."""
    return max((agg.global_seqs or 0.0) / 2, 1.0)


def pair_shares(
    keys: tuple[str, ...], loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, pairs: float
) -> dict[str, torch.Tensor | float]:
    """A pair objective's step metrics, named by ``keys`` (its ``share_keys``, in this order): the loss, then as shares
    of the batch's ``pairs``: the accuracy (chosen above rejected; a tie counts as wrong), the chosen and the rejected
    values (P,), and their margin."""
    margins = chosen - rejected
    shares = ((margins > 0).sum(), chosen.sum(), rejected.sum(), margins.sum())
    return dict(zip(keys, (loss.detach(), *(share / pairs for share in shares)), strict=True))


class DirectPreference(Objective):
    """``settings``: the PreferenceConfig (the loss type, beta, label smoothing)."""

    name = "dpo"
    paired = True
    reference = True
    share_keys = (DPO_LOSS, "dpo/reward_accuracy", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/reward_margin")
    shown = ((DPO_LOSS, "loss"), ("dpo/reward_accuracy", "reward acc"), ("val/dpo/reward_accuracy", "val acc"))

    def __init__(self, settings: PreferenceConfig):
        super().__init__(settings)
        self.length_normalized = PREFERENCE_LOSSES.get(settings.loss_type).length_normalized

    def _answers(self, token_log_probs: torch.Tensor, batch: Columns) -> torch.Tensor:
        return answer_log_probs(token_log_probs, batch[RESPONSE_MASK], self.length_normalized)

    def loss(self, outputs: ForwardOutputs, batch: Columns, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        policy = self._answers(outputs.log_probs, batch)
        reference = self._answers(batch[REF_LOG_PROB], batch)
        output = preference_loss(*pair_halves(policy), *pair_halves(reference), self.settings)
        pairs = batch_pairs(agg)
        loss = output.losses.sum() / pairs
        return loss, pair_shares(self.share_keys, loss, output.chosen_rewards, output.rejected_rewards, pairs)

    def held_out_rows(self, outputs: ForwardOutputs, batch: Columns) -> dict[str, torch.Tensor]:
        return {
            ANSWER_LOG_PROB: self._answers(outputs.log_probs, batch),
            REF_ANSWER_LOG_PROB: self._answers(outputs.reference_log_probs, batch),
        }

    def held_out_metrics(self, rows: Columns) -> dict[str, float]:
        scores = preference_loss(
            *pair_halves(rows[ANSWER_LOG_PROB]), *pair_halves(rows[REF_ANSWER_LOG_PROB]), self.settings
        )
        return {f"val/{key}": value for key, value in pair_metrics(scores).items()}
