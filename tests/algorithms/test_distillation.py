"""On-policy distillation's advantage: -(log π_student - log π_teacher) per generated token, mixed with the task's."""

import math

import pytest
import torch

from hybridflow.algorithms.distillation import DistillationConfig, distillation_advantages, reverse_kl_advantage
from hybridflow.validation import InvalidSetting

LN2, LN4 = math.log(2.0), math.log(4.0)
# two responses of three tokens; the second's last token is padding
STUDENT = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 1.0, 0.3]], dtype=torch.float64))
TEACHER = torch.log(torch.tensor([[0.25, 0.25, 1.0], [1.0, 0.25, 0.9]], dtype=torch.float64))
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def config(coef: float = 1.0, reward_coef: float = 0.0) -> DistillationConfig:
    return DistillationConfig(coef=coef, reward_coef=reward_coef)


def test_reverse_kl_advantage_by_hand():
    # -(ln .5 - ln .25) = -ln 2; -(ln .25 - ln .25) = 0; -(ln .5 - ln 1) = ln 2; -(ln 1 - ln .25) = -ln 4;
    # padding 0 whatever the values
    expected = torch.tensor([[-LN2, 0.0, LN2], [LN2, -LN4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(reverse_kl_advantage(STUDENT, TEACHER, MASK), expected)


def test_distillation_alone_and_its_metrics():
    task = torch.full_like(MASK, 7.0)  # ignored with reward_coef=0
    advantages, metrics = distillation_advantages(task, STUDENT, TEACHER, MASK, config(coef=0.5))
    torch.testing.assert_close(
        advantages, 0.5 * torch.tensor([[-LN2, 0.0, LN2], [LN2, -LN4, 0.0]], dtype=torch.float64)
    )
    # δ on the 5 generated tokens: ln2, 0, -ln2, -ln2, ln4 -> mean ln2 / 5; per response 0 and ln2 -> ln2 / 2
    assert metrics["distill/reverse_kl_mean"] == pytest.approx(LN2 / 5)
    assert metrics["distill/reverse_kl_seq_mean"] == pytest.approx(LN2 / 2)
    assert metrics["distill/advantage_share"] == 1.0


def test_the_mix_adds_the_task_advantage_on_generated_tokens_only():
    task = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    advantages, metrics = distillation_advantages(task, STUDENT, TEACHER, MASK, config(coef=1.0, reward_coef=0.5))
    expected = torch.tensor([[-LN2 + 0.5, 0.5, LN2 + 0.5], [LN2 - 1.0, -LN4 - 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)
    teacher_size, task_size = 3 * LN2 + LN4, 3 * 0.5 + 2 * 1.0  # sums of |part| over the generated tokens
    assert metrics["distill/advantage_share"] == pytest.approx(teacher_size / (teacher_size + task_size))


def test_a_teacher_equal_to_the_student_gives_zero():
    advantages, metrics = distillation_advantages(torch.zeros_like(MASK), STUDENT, STUDENT.clone(), MASK, config())
    assert advantages.abs().max().item() == 0.0
    assert metrics["distill/reverse_kl_mean"] == 0.0 and metrics["distill/advantage_share"] == 0.0


def test_settings_are_checked():
    with pytest.raises(InvalidSetting, match="coef"):
        config(coef=-1.0)
    with pytest.raises(InvalidSetting, match="reward_coef"):
        config(reward_coef=-0.1)
    with pytest.raises(InvalidSetting, match="both 0"):
        config(coef=0.0, reward_coef=0.0)
