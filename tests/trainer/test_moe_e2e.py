"""Whole GRPO runs with a mixture-of-experts actor, rewarded for digits as tests/trainer/test_train_e2e.py's dense
run: tiny Mixtral and OLMoE generating on the native engine, and tiny Qwen3-MoE through transformers' generate (the
other backend's path). The reward rises, and every step reports the routers' balancing loss and each layer's expert
load. With routing replay (R3) in fp32, the trainer's log-probs equal the rollout's at every step; with R2 the update
replays the routes of the trainer's own old-log-prob pass, and with agent loops every token of the conversation
(both turns, the tool's answer between them) is trained through the rollout's experts."""

import json
import math

import pytest
from agent_loops import CALCULATE_THEN_ANSWER
from test_train_e2e import digits_run

from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.config import load_config

pytestmark = pytest.mark.slow

REPLAY = [
    "actor_rollout_ref.actor.router_replay.mode=R3",
    "actor_rollout_ref.rollout.dtype=fp32",
    "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
]
OWN_OLD_LOG_PROB_PASS = "actor_rollout_ref.actor.reuse_update_log_probs=false"  # replayed too, besides the update
# R2: the update replays the old-log-prob pass's routes, over 2 optimizer steps a batch (the second after the weights
# moved, where the update's own routing may differ)
R2 = ["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


@pytest.mark.parametrize(
    "model, rollout, extra",
    [
        ("tiny-mixtral", "native", []),
        ("tiny-olmoe", "native", REPLAY),
        ("tiny-qwen3-moe", "hf", [*REPLAY, OWN_OLD_LOG_PROB_PASS]),
        ("tiny-qwen3-moe", "native", [*R2, OWN_OLD_LOG_PROB_PASS]),
    ],
)
def test_grpo_trains_a_mixture_of_experts_to_emit_digits(local_ray, arithmetic_files, tmp_path, model, rollout, extra):
    moe = [f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.name={rollout}"]
    records = digits_run(arithmetic_files, tmp_path, *moe, "actor_rollout_ref.actor.router_aux_loss_coef=0.01", *extra)
    for record in records:
        loads = [record[f"actor/expert_load_max/layer_{layer}"] for layer in (0, 1)]
        assert 0 < record["actor/router_aux_loss"] < 4 and all(math.isfinite(load) for load in loads)
        if REPLAY[0] in extra:  # the rollout's routes replayed (fp32): the log-probs agree as for a dense model
            assert record["rollout/log_prob_diff_max"] < 1e-4, record["rollout/log_prob_diff_max"]
            assert 0 <= record["router_replay/changed_update"] < 0.05
        if REPLAY[0] in extra and OWN_OLD_LOG_PROB_PASS in extra:
            assert 0 <= record["router_replay/changed_log_prob"] < 0.05
        if R2[0] in extra:  # the update replayed the old-log-prob pass's routes; that pass replays nothing
            assert 0 <= record["router_replay/changed_update"] <= 1 and "router_replay/changed_log_prob" not in record
    if R2[0] in extra:  # at a learning rate of 2e-2, the second optimizer step's own routing moved (a third of it)
        assert max(record["router_replay/changed_update"] for record in records) > 0.01


def test_agent_loops_replay_the_rollouts_routes_over_every_turn(local_ray, arithmetic_files, tmp_path):
    """Two turns around a calculator call on a tiny OLMoE, R3 in fp32: the trainer's log-probs equal the rollout's at
    every step, through the old-log-prob pass and the update, as for single-turn generation."""
    (tmp_path / "loop.py").write_text(CALCULATE_THEN_ANSWER)
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    train, _ = arithmetic_files
    config = load_config(
        [
            f"data.train_files=[{train}]",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.response_length=32",
            "actor_rollout_ref.model.path=tiny-olmoe",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.default_agent={tmp_path / 'loop.py'}:CalculateThenAnswer",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
            "actor_rollout_ref.actor.optim.lr=2e-2",
            "trainer.total_training_steps=3",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *REPLAY,
            OWN_OLD_LOG_PROB_PASS,
        ]
    )
    run(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for record in records:
        assert record["agent/num_turns/mean"] == 2.0 and record["agent/stop/failed"] == 0.0
        assert record["rollout/log_prob_diff_max"] < 1e-4, record["rollout/log_prob_diff_max"]
        assert 0 <= record["router_replay/changed_log_prob"] < 0.05
        assert 0 <= record["router_replay/changed_update"] < 0.05
