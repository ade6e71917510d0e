"""On-policy distillation: a teacher's per-token log-probs of the student's own samples as the advantage.

The student samples a response; the teacher scores each sampled token. With δ_t = log π_student(y_t) -
log π_teacher(y_t), the per-token reverse KL estimate of KL(π_student ‖ π_teacher) at step t is δ_t, and

    A_t = coef · (-δ_t) + reward_coef · A_task_t

is the advantage the policy loss trains with: tokens the teacher finds likelier than the student did are
pushed up, the others down. Each token's advantage is its own δ (no discount, no baseline): the reverse KL
of one token is known exactly where it was sampled, which is what makes the signal dense. ``reward_coef``
mixes in the task reward's advantage (the configured estimator's), so distillation and RL combine; 0 is
distillation alone. Minimising E[δ] over the student's own samples is minimising the reverse KL, which is
mode-seeking: the student learns to avoid what the teacher would not say (Agarwal et al. 2024, GKD;
Thinking Machines, "On-policy distillation", 2025).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.algorithms.masked import masked_mean, masked_sum
from hybridflow.validation import require


@dataclass(kw_only=True)
class DistillationConfig:
    """How the teacher's log-probs enter the advantage (read only when teacher.model.path is set)."""

    coef: float  # weight of the teacher's per-token signal -(log pi_student - log pi_teacher) in the advantage
    reward_coef: float  # weight of the task reward's advantage (algorithm.adv_estimator's) beside it; 0: none

    def __post_init__(self) -> None:
        require(self.coef >= 0, "coef", f"must be >= 0, got {self.coef}")
        require(self.reward_coef >= 0, "reward_coef", f"must be >= 0, got {self.reward_coef}")
        require(
            self.coef > 0 or self.reward_coef > 0,
            "coef",
            "coef and reward_coef are both 0: every advantage would be 0",
            "set coef=1 (distillation), reward_coef=1 (the task reward), or both",
        )


def reverse_kl_advantage(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """-(log π_student - log π_teacher) on the generated tokens (``mask``), 0 elsewhere; all (B, R)."""
    return torch.where(mask.bool(), teacher_log_probs - student_log_probs, 0.0)


def distillation_advantages(
    task_advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    config: DistillationConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mixed advantage (B, R), and its metrics: ``distill/reverse_kl_mean`` (δ per generated token, over the
    batch), ``distill/reverse_kl_seq_mean`` (δ summed over each response, averaged), ``distill/advantage_share``
    (the teacher's share of the advantage's absolute size over the generated tokens)."""
    teacher_part = config.coef * reverse_kl_advantage(student_log_probs, teacher_log_probs, mask)
    task_part = config.reward_coef * task_advantages * mask
    delta = torch.where(mask.bool(), student_log_probs - teacher_log_probs, 0.0)
    teacher_size, task_size = masked_sum(teacher_part.abs(), mask), masked_sum(task_part.abs(), mask)
    total = teacher_size + task_size
    metrics = {
        "distill/reverse_kl_mean": masked_mean(delta, mask).item(),
        "distill/reverse_kl_seq_mean": delta.sum(dim=1).mean().item(),
        "distill/advantage_share": (teacher_size / total).item() if total > 0 else 0.0,
    }
    return teacher_part + task_part, metrics
