"""Whole GRPO runs with a mixture-of-experts actor, rewarded for digits as tests/trainer/test_train_e2e.py's dense
run: tiny Mixtral generating on the native engine, and tiny Qwen3-MoE through transformers' generate (the native
engine runs Mixtral's layers, not Qwen3's). The reward rises, and every step reports the routers' balancing loss and
each layer's expert load."""

import math

import pytest
from test_train_e2e import digits_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model, rollout", [("tiny-mixtral", "native"), ("tiny-qwen3-moe", "hf")])
def test_grpo_trains_a_mixture_of_experts_to_emit_digits(local_ray, arithmetic_files, tmp_path, model, rollout):
    moe = [f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.name={rollout}"]
    records = digits_run(arithmetic_files, tmp_path, *moe, "actor_rollout_ref.actor.router_aux_loss_coef=0.01")
    for record in records:
        loads = [record[f"actor/expert_load_max/layer_{layer}"] for layer in (0, 1)]
        assert 0 < record["actor/router_aux_loss"] < 4 and all(math.isfinite(load) for load in loads)
