"""The RL roles' objectives from the registry (``policy``: the actor's, ``value``: the critic's) against hand
computations: PPO's clipped surrogate minus the entropy bonus plus the k1 KL loss, token-mean over the masked
tokens; the clipped value loss, half the larger squared error, token-mean."""

import dataclasses

import torch

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives import OBJECTIVES, TOKEN_VALUES, ForwardOutputs
from hybridflow.batch_keys import ADVANTAGES, OLD_LOG_PROBS, REF_LOG_PROB, RESPONSE_MASK, RETURNS, VALUES
from hybridflow.trainer.setup.config import load_config

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def masked_mean(x: torch.Tensor) -> torch.Tensor:
    return (x * MASK).sum() / MASK.sum()


def test_the_policy_objective_is_the_clipped_surrogate_with_entropy_and_kl():
    actor = load_config([]).actor_rollout_ref.actor
    actor = dataclasses.replace(actor, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")
    objective = OBJECTIVES.get("policy")(actor)
    torch.manual_seed(0)
    old = -torch.rand(2, 4)
    log_probs = (old + torch.tensor([[0.5, -0.05, 0.1, 9.0], [-0.5, 0.02, 9.0, 9.0]])).requires_grad_()
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]])
    entropy, ref = torch.rand(2, 4), -torch.rand(2, 4)
    batch = {OLD_LOG_PROBS: old, ADVANTAGES: advantages, RESPONSE_MASK: MASK, REF_LOG_PROB: ref}
    loss, metrics = objective.loss(ForwardOutputs(log_probs=log_probs, entropy=entropy), batch, LossAggregation())

    eps = actor.policy_loss.clip_ratio
    ratio = torch.exp(log_probs - old)
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - eps, 1 + eps))
    expected = masked_mean(surrogate) - 0.01 * masked_mean(entropy) + 0.1 * masked_mean(log_probs - ref)
    torch.testing.assert_close(loss, expected)
    assert set(objective.share_keys) <= set(metrics) and metrics["actor/kl_coef"] == 0.1
    torch.testing.assert_close(metrics["actor/pg_loss"], masked_mean(surrogate).detach())
    loss.backward()
    # the clipped tokens (ratio e^0.5 > 1 + eps with A > 0; e^-0.5 < 1 - eps with A < 0): the KL term's gradient
    # alone, kl_loss_coef over the 5 tokens; the padding none
    torch.testing.assert_close(log_probs.grad[:, 0], torch.full((2,), 0.1 / 5))
    assert log_probs.grad[0, 3] == 0 and log_probs.grad[1, 2:].abs().sum() == 0


def test_the_value_objective_is_the_clipped_value_loss():
    critic = load_config([]).critic
    objective = OBJECTIVES.get("value")(critic)
    assert objective.output == TOKEN_VALUES
    old = torch.tensor([[0.0, 1.0, 2.0, 5.0], [1.0, -1.0, 0.0, 0.0]])
    new = torch.tensor([[1.0, 1.1, 1.0, 7.0], [0.0, -1.0, 3.0, 3.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    batch = {VALUES: old, RETURNS: returns, RESPONSE_MASK: MASK}
    loss, metrics = objective.loss(ForwardOutputs(values=new), batch, LossAggregation())
    clip = critic.cliprange_value
    clipped = old + (new - old).clamp(-clip, clip)
    expected = 0.5 * masked_mean(torch.maximum((new - returns) ** 2, (clipped - returns) ** 2))
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["critic/vf_loss"], expected)
