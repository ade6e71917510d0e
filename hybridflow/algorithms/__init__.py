"""The RL math of hybridflow: pure functions of tensors (no I/O, no distributed calls).

- masked.py       masked sum / mean / var / whiten, safe on empty masks
- aggregation.py  loss_agg_mode and the gradient-accumulation contract
- config.py       AlgorithmConfig: the `algorithm.*` section
- advantage.py    AdvantageConfig and the estimator registry (algorithm.adv_estimator)
- estimators.py   gae, grpo, rloo, reinforce_plus_plus(_baseline), remax, opo, gpg, grpo_passk, pass_at_k
- policy_loss.py  PolicyLossConfig, the loss registry (actor.policy_loss.loss_mode) and
                  vanilla, gspo, gpg, cispo; cov_losses.py: clip_cov, kl_cov; soft_losses.py:
                  geo_mean, sapo, dro; dppo_losses.py: dppo_tv, dppo_kl
- rollout_correction.py  importance weights / rejection between trainer and rollout, diagnostics
- dynamic_sampling.py    DAPO's group filter (algorithm.filter_groups)
- value_loss.py   clipped critic loss
- distillation.py on-policy distillation's reverse-KL advantage (algorithm.distillation)
- preference.py   DPO, IPO and hinge pair losses (PREFERENCE_LOSSES), the Bradley-Terry reward-model loss
- kl.py           KL estimators, KL controllers (KLControlConfig), KL in the reward or as a loss
- entropy.py      entropy and log-probs from logits

docs/algorithms.md lists every estimator, loss and KL type with its formula.
"""

from hybridflow.algorithms import cov_losses as _cov_losses  # noqa: F401  (registers clip_cov, kl_cov)
from hybridflow.algorithms import dppo_losses as _dppo_losses  # noqa: F401  (registers dppo_tv, dppo_kl)
from hybridflow.algorithms import estimators as _estimators  # noqa: F401  (registers the estimators)
from hybridflow.algorithms import soft_losses as _soft_losses  # noqa: F401  (registers geo_mean, sapo, dro)
from hybridflow.algorithms.advantage import (
    AdvantageConfig,
    AdvantageEstimator,
    get_adv_estimator,
    list_adv_estimators,
    register_adv_estimator,
)
from hybridflow.algorithms.aggregation import AGG_MODES, LossAggregation, agg_loss, count_tokens_and_seqs
from hybridflow.algorithms.config import AlgorithmConfig
from hybridflow.algorithms.entropy import entropy_from_logits, log_probs_from_logits
from hybridflow.algorithms.kl import (
    KL_CONTROLLERS,
    KL_TYPES,
    AdaptiveKLController,
    FixedKLController,
    KLControlConfig,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
    make_kl_controller,
)
from hybridflow.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.algorithms.policy_loss import (
    PolicyLossConfig,
    get_policy_loss,
    list_policy_losses,
    register_policy_loss,
)
from hybridflow.algorithms.value_loss import compute_value_loss

__all__ = [
    "AGG_MODES",
    "KL_CONTROLLERS",
    "KL_TYPES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageEstimator",
    "AlgorithmConfig",
    "FixedKLController",
    "KLControlConfig",
    "LossAggregation",
    "PolicyLossConfig",
    "agg_loss",
    "apply_kl_penalty",
    "compute_kl_loss",
    "compute_value_loss",
    "count_tokens_and_seqs",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_policy_loss",
    "kl_penalty",
    "list_adv_estimators",
    "list_policy_losses",
    "log_probs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
]
