"""Whole GRPO runs with a mixture-of-experts actor, rewarded for digits as tests/trainer/test_train_e2e.py's dense
run: tiny Mixtral generating on the native engine, and tiny Qwen3-MoE through transformers' generate (the native
engine runs Mixtral's layers, not Qwen3's). The reward rises, and every step reports the routers' balancing loss and
each layer's expert load."""

import json
import math

import pytest
from test_train_e2e import DIGITS_REWARD

from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.config import load_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model, rollout", [("tiny-mixtral", "native"), ("tiny-qwen3-moe", "hf")])
def test_grpo_trains_a_mixture_of_experts_to_emit_digits(local_ray, arithmetic_files, tmp_path, model, rollout):
    reward_file = tmp_path / "digits.py"
    reward_file.write_text(DIGITS_REWARD)
    train, _ = arithmetic_files
    config = load_config(
        [
            f"data.train_files=[{train}]",
            f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.rollout.name={rollout}",
            "actor_rollout_ref.actor.router_aux_loss_coef=0.01",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.response_length=8",
            "actor_rollout_ref.actor.optim.lr=2e-2",
            "trainer.total_training_steps=10",
            "trainer.total_epochs=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={tmp_path}",
            f"custom_reward_function.path={reward_file}",
        ]
    )
    run(config)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scores = [record["critic/score/mean"] for record in records]
    assert len(scores) == 10
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert first < 0.1 and last > first + 0.5, scores
    for record in records:
        loads = [record[f"actor/expert_load_max/layer_{layer}"] for layer in (0, 1)]
        assert 0 < record["actor/router_aux_loss"] < 4 and all(math.isfinite(load) for load in loads)
