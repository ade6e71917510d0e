"""The `algorithm.*` section: the advantage estimator and its settings, KL in the reward, and what the
driver does to a batch before the updates (rollout correction, dynamic sampling, truncated responses)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.algorithms.advantage import AdvantageConfig, list_adv_estimators
from hybridflow.algorithms.distillation import DistillationConfig
from hybridflow.algorithms.dynamic_sampling import FilterGroupsConfig
from hybridflow.algorithms.kl import KL_TYPES, KLControlConfig
from hybridflow.algorithms.rollout_correction import RolloutCorrectionConfig
from hybridflow.validation import require_choice


@dataclass(kw_only=True)
class AlgorithmConfig(AdvantageConfig):
    """The advantage estimator and its settings, and KL in the reward.

    The estimator's own settings (gamma, lam, ...) are AdvantageConfig's fields, inherited: the
    driver hands this config to the estimator as it is."""

    # a registered advantage estimator: gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax |
    # opo | gpg | grpo_passk | pass_at_k
    adv_estimator: str
    use_kl_in_reward: bool  # subtract beta * KL(pi || ref) from the per-token reward
    kl_penalty: str  # KL estimator used in the reward (KL_TYPES)
    kl_ctrl: KLControlConfig  # the coefficient beta of that penalty
    # trainer vs rollout mismatch: importance weights and rejection (the rollout_corr/* diagnostics always)
    rollout_correction: RolloutCorrectionConfig
    filter_groups: FilterGroupsConfig  # DAPO's dynamic sampling: train only on groups whose rewards differ
    mask_truncated_responses: bool  # responses cut at the length budget leave the updates (DAPO's overlong filter)
    # on-policy distillation (a teacher: teacher.model.path): its per-token reverse KL in the advantage
    distillation: DistillationConfig

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice(self.adv_estimator, list_adv_estimators(), "adv_estimator")
        require_choice(self.kl_penalty, KL_TYPES, "kl_penalty")
