"""The RL actor's objective: the policy loss of ``actor.policy_loss.loss_mode`` (policy_loss.py's registry: PPO's
clipped surrogate and its relatives) over each sampled token's log-prob, minus ``entropy_coeff`` x the entropy,
plus ``kl_loss_coef`` x the KL to the reference policy under ``use_kl_loss``.

Its rows are an RL step's: the sampled responses with their ``advantages`` (on-policy distillation's teacher signal
arrives here too, in the advantage: distillation.py), the old policy's ``old_log_probs`` (the engine supplies them:
the old pass's, the rollout's, or the update's own before its one step) and, for the KL loss, the reference's
``ref_log_prob`` (the step's reference pass, a role of its own). RL has no held-out pass of its objective: a run is
validated by the reward of answers it generates.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import LossAggregation, agg_loss
from hybridflow.algorithms.kl import compute_kl_loss
from hybridflow.algorithms.objectives.base import Columns, ForwardOutputs, Objective
from hybridflow.algorithms.policy_loss import get_policy_loss
from hybridflow.batch_keys import ADVANTAGES, OLD_LOG_PROBS, REF_LOG_PROB, RESPONSE_MASK, ROLLOUT_IS_WEIGHTS

PG_LOSS = "actor/pg_loss"
ENTROPY_LOSS = "actor/entropy_loss"
KL_LOSS = "actor/kl_loss"


class PolicyGradient(Objective):
    """``settings``: the actor's section (``actor_rollout_ref.actor``: ``policy_loss``, ``entropy_coeff``,
    ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``)."""

    name = "policy"
    share_keys = (PG_LOSS, ENTROPY_LOSS, KL_LOSS)

    def __init__(self, settings):
        super().__init__(settings)
        self.policy_loss = get_policy_loss(settings.policy_loss.loss_mode)

    @property
    def entropy_in_loss(self) -> bool:
        """Whether the loss reads the entropy (with its gradient): ``entropy_coeff`` != 0."""
        return self.settings.entropy_coeff != 0

    def loss(self, outputs: ForwardOutputs, batch: Columns, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        cfg = self.settings
        log_prob, mask = outputs.log_probs, batch[RESPONSE_MASK]
        policy_agg = agg.weighted(batch.get(ROLLOUT_IS_WEIGHTS, None))
        pg_loss, pg_metrics = self.policy_loss(
            batch[OLD_LOG_PROBS], log_prob, batch[ADVANTAGES], mask, cfg.policy_loss, policy_agg
        )
        loss = pg_loss
        metrics = {f"actor/{k}": v for k, v in pg_metrics.items()}
        metrics[PG_LOSS] = pg_loss.detach()
        if self.entropy_in_loss:
            entropy_loss = agg_loss(outputs.entropy, mask, agg)
            loss = loss - cfg.entropy_coeff * entropy_loss
            metrics[ENTROPY_LOSS] = entropy_loss.detach()
        if cfg.use_kl_loss:
            kl_loss = compute_kl_loss(log_prob, batch[REF_LOG_PROB], mask, cfg.kl_loss_type, agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics[KL_LOSS] = kl_loss.detach()
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        return loss, metrics
