"""An on-policy update takes its old log-probs from its own forward, exactly as a separate pass would."""

import pytest
import torch

from hybridflow.batch_keys import ENTROPYS, METRICS, OLD_LOG_PROBS, RESPONSE_MASK
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.policy import PolicyEngine
from hybridflow.models import load_causal_lm


def _engine(config) -> PolicyEngine:
    torch.manual_seed(0)
    model = load_causal_lm(config.model.path, dtype=torch.float32)
    return PolicyEngine(TrainedModel.build(model, config.actor.optim, 10), config.actor)


def test_pre_update_log_probs_and_step_equal_the_separate_pass(tiny_path, rollout_batch, actor_config_factory):
    config = actor_config_factory(tiny_path, 0.5)  # micro-batches of 2: the rows come back in order
    separate, reusing = _engine(config), _engine(config)

    data = rollout_batch.select(deepcopy=True)
    separate_pass = separate.compute_log_prob(data, 1.0, with_entropy=True)
    old_log_probs, entropy = separate_pass.batch[OLD_LOG_PROBS], separate_pass.batch[ENTROPYS]
    data.batch[OLD_LOG_PROBS] = old_log_probs
    separate_update = separate.update_policy(data, len(data), 1.0, seed=0)
    assert separate_update.batch is None  # given old log-probs, the update returns its metrics alone

    on_policy = rollout_batch.select(deepcopy=True)
    reusing_update = reusing.update_policy(on_policy, len(on_policy), 1.0, seed=0)
    assert OLD_LOG_PROBS not in on_policy.batch.keys()  # the caller's batch is left as it was
    mask = rollout_batch.batch[RESPONSE_MASK].bool()
    returned = reusing_update.batch
    torch.testing.assert_close(returned[OLD_LOG_PROBS][mask], old_log_probs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(returned[ENTROPYS][mask], entropy[mask], atol=1e-5, rtol=0)
    reusing_loss = reusing_update.meta_info[METRICS]["actor/pg_loss"]
    assert reusing_loss == pytest.approx(separate_update.meta_info[METRICS]["actor/pg_loss"], abs=1e-6)
    for (name, weight), expected in zip(reusing.model.named_parameters(), separate.model.parameters()):
        torch.testing.assert_close(weight, expected, atol=1e-6, rtol=1e-5, msg=name)


def test_an_update_that_is_not_on_policy_needs_old_log_probs(tiny_path, rollout_batch, actor_config_factory):
    engine = _engine(actor_config_factory(tiny_path, 0.5))
    with pytest.raises(ValueError, match="not one optimizer step"):
        engine.update_policy(rollout_batch.select(deepcopy=True), 2, 1.0, seed=0)  # three optimizer steps
