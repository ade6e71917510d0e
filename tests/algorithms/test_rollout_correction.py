"""Rollout correction on a 2 x 3 batch worked out by hand.

log ρ = log π_old - log π_rollout, mask [[1, 1, 1], [1, 1, 0]]:
  row 0: ρ = [2, 1, 1/2]  (Π ρ = 1)
  row 1: ρ = [4, 2, --]   (Π ρ = 8; the third token is padding)
"""

import math

import pytest
import torch

from hybridflow.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    correction_diagnostics,
    effective_sample_size,
    importance_weights,
    rejection_keep,
    rollout_correction,
)
from hybridflow.validation import InvalidSetting

LN2 = math.log(2.0)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ROLLOUT = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -7.0]])
LOG_RATIO = torch.tensor([[LN2, 0.0, -LN2], [2 * LN2, LN2, 5.0]])  # the 5.0 sits on padding: ignored
OLD = ROLLOUT + LOG_RATIO


def config(**overrides) -> RolloutCorrectionConfig:
    values = dict(
        rollout_is=None,
        rollout_is_mode="truncate",
        rollout_is_threshold=2.0,
        rollout_rs=None,
        rollout_rs_threshold_lower=0.5,
        rollout_rs_threshold=2.0,
    )
    return RolloutCorrectionConfig(**(values | overrides))


def masked_log_ratio() -> torch.Tensor:
    return LOG_RATIO * MASK


@pytest.mark.parametrize(
    "level, mode, expected",
    [
        ("token", "truncate", [[2.0, 1.0, 0.5], [2.0, 2.0, 0.0]]),  # 4 capped at 2
        ("token", "mask", [[2.0, 1.0, 0.5], [0.0, 2.0, 0.0]]),  # 4 > 2 zeroed; 2 is not above the cap
        ("sequence", "truncate", [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]),  # row weights 1 and min(8, 2)
        ("sequence", "mask", [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),  # row 1's 8 > 2: the whole row zeroed
    ],
)
def test_importance_weights(level, mode, expected):
    weights = importance_weights(masked_log_ratio(), MASK.float(), level, mode, threshold=2.0)
    assert torch.allclose(weights, torch.tensor(expected), atol=1e-6)
    assert not weights.requires_grad


@pytest.mark.parametrize(
    "level, expected",
    [
        ("token", [[True, True, True], [False, True, False]]),  # ρ = 4 leaves [1/2, 2]; the band is inclusive
        ("sequence", [[True, True, True], [False, False, False]]),  # Π ρ = 8 leaves the band
        ("geometric", [[True, True, True], [False, False, False]]),  # √8 ≈ 2.83 leaves it too
    ],
)
def test_rejection_keep(level, expected):
    keep = rejection_keep(masked_log_ratio(), MASK.float(), level, lower=0.5, upper=2.0)
    assert keep.tolist() == expected


def test_geometric_rejection_keeps_a_long_row_that_sequence_rejects():
    # 3 tokens of ρ = 1.5: the product 3.375 leaves [0.5, 2], the per-token mean 1.5 does not
    log_ratio = torch.full((1, 3), math.log(1.5))
    mask = torch.ones(1, 3)
    assert not rejection_keep(log_ratio, mask, "sequence", 0.5, 2.0).any()
    assert rejection_keep(log_ratio, mask, "geometric", 0.5, 2.0).all()


def test_diagnostics_by_hand():
    metrics = correction_diagnostics(OLD, ROLLOUT, MASK)
    rho = [2.0, 1.0, 0.5, 4.0, 2.0]
    log_rho = [math.log(r) for r in rho]
    assert metrics["rollout_corr/kl"] == pytest.approx(-sum(log_rho) / 5)  # -3 ln2 / 5
    assert metrics["rollout_corr/k3_kl"] == pytest.approx((4.5 - 3 * LN2) / 5)
    assert metrics["rollout_corr/chi2_token"] == pytest.approx((4 + 1 + 0.25 + 16 + 4) / 5 - 1)  # 4.05
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx((1 + 64) / 2 - 1)  # 31.5
    assert metrics["rollout_corr/ess_token"] == pytest.approx(9.5**2 / (5 * 25.25))
    assert metrics["rollout_corr/ess_seq"] == pytest.approx(81 / (2 * 65))
    assert metrics["rollout_corr/log_ratio_mean"] == pytest.approx(3 * LN2 / 5)
    assert metrics["rollout_corr/log_ratio_abs_mean"] == pytest.approx(5 * LN2 / 5)
    # per-row mean log-probs: row 0 old -1, rollout -1; row 1 old -2 + 1.5 ln2, rollout -2
    assert metrics["rollout_corr/training_ppl"] == pytest.approx((math.e + math.exp(2 - 1.5 * LN2)) / 2)
    assert metrics["rollout_corr/rollout_ppl"] == pytest.approx((math.e + math.e**2) / 2)
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx(-0.75 * LN2)


def test_identical_policies_give_the_ideal_diagnostics():
    metrics = correction_diagnostics(ROLLOUT, ROLLOUT, MASK)
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ratio_abs_mean"):
        assert metrics[f"rollout_corr/{key}"] == pytest.approx(0.0, abs=1e-7), key
    assert metrics["rollout_corr/ess_token"] == pytest.approx(1.0)
    assert metrics["rollout_corr/training_ppl"] == pytest.approx(metrics["rollout_corr/rollout_ppl"])


def test_effective_sample_size():
    assert effective_sample_size(torch.ones(7)) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert effective_sample_size(torch.tensor([])) == 0.0


def test_rollout_correction_token_tis_with_sequence_rejection():
    result = rollout_correction(OLD, ROLLOUT, MASK, config(rollout_is="token", rollout_rs="sequence"))
    assert torch.allclose(result.weights, torch.tensor([[2.0, 1.0, 0.5], [2.0, 2.0, 0.0]]), atol=1e-6)
    assert result.keep.tolist() == [[True, True, True], [False, False, False]]
    m = result.metrics
    assert m["rollout_corr/rejected_token_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rejected_seq_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_corr/is_clipped_fraction"] == pytest.approx(1 / 5)  # only ρ = 4 is above 2
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(7.5 / 5)
    assert m["rollout_corr/is_weight_max"] == pytest.approx(2.0)
    assert m["rollout_corr/is_ess"] == pytest.approx(7.5**2 / (5 * 13.25))
    assert m["rollout_corr/kl"] == pytest.approx(-3 * LN2 / 5)  # the diagnostics come along


def test_sequence_weights_count_capped_rows():
    result = rollout_correction(OLD, ROLLOUT, MASK, config(rollout_is="sequence", rollout_is_mode="mask"))
    assert result.metrics["rollout_corr/is_clipped_fraction"] == pytest.approx(1 / 2)
    assert result.keep.tolist() == MASK.bool().tolist()  # no rejection asked for
    assert "rollout_corr/is_weight_mean" in result.metrics


def test_off_by_default_and_checked():
    assert not config().enabled
    assert config(rollout_rs="token").enabled
    with pytest.raises(InvalidSetting, match="rollout_is"):
        config(rollout_is="tokens")
    with pytest.raises(InvalidSetting, match="rollout_rs_threshold"):
        config(rollout_rs_threshold=0.4)  # below the lower bound
    with pytest.raises(InvalidSetting, match="rollout_is_mode"):
        config(rollout_is_mode="clip")
