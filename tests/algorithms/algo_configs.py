"""Configs of the algorithms built by keyword, for tests: every field given here, the test's own values
(they equal the YAML defaults today, but the hand-computed numbers in the tests depend on these)."""

import dataclasses

from hybridflow.algorithms import AdvantageConfig, PolicyLossConfig

ADVANTAGE = AdvantageConfig(
    gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, epsilon=1e-6, gae_whiten=True, pass_k=4, gpg_norm_by_std=False
)
POLICY_LOSS = PolicyLossConfig(
    loss_mode="vanilla",
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    clip_ratio_c=3.0,
    clip_cov_ratio=0.0002,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    kl_cov_ratio=0.0002,
    ppo_kl_coef=1.0,
    tau_pos=1.0,
    tau_neg=1.05,
    dro_beta=0.1,
    log_ratio_clamp=20.0,
)


def advantage_config(**changes) -> AdvantageConfig:
    return dataclasses.replace(ADVANTAGE, **changes)


def policy_loss_config(**changes) -> PolicyLossConfig:
    return dataclasses.replace(POLICY_LOSS, **changes)
