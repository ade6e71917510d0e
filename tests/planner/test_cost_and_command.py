"""The cost model's formulas by hand, and `hybridflow plan` writing a config that `hybridflow train` accepts."""

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from hybridflow.cli import main as cli
from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.planner.cluster import cluster_preset
from hybridflow.planner.cost import generation_seconds, memory_bytes, pass_seconds, stage_seconds, switch_seconds
from hybridflow.planner.workload import ModelShape, Workload, workload_from_config
from hybridflow.trainer.setup.check_config import check_config
from hybridflow.trainer.setup.config import load_config

SHAPE = ModelShape(name="m", layers=2, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=10, tied_embeddings=True)
CLUSTER = replace(
    cluster_preset("a100-80g"), flops=1000.0, train_efficiency=0.5, decode_efficiency=0.5, memory_bandwidth=100.0,
    intra_node_bandwidth=50.0, collective_latency=0.01, layer_overhead=0.0,
    decode_layer_overhead=0.0,
)  # fmt: skip
ONE = LayoutShape(dp=1, t=1, tg=1)  # one device
WORK = Workload(models={Role.ActorRollout: SHAPE}, prompts=2, n=2, prompt_length=3, response_length=1, micro_batch=4)


def test_the_shape_counts_weights_by_hand():
    # per layer: q,k,v 8x(2+2+2... ) = 8*8*3, o 8*8, MLP 3*8*16, norms 2*8
    assert SHAPE.layer_params == 2 * (8 * 24 + 64 + 384 + 16)
    assert SHAPE.embedding_params == 80 and SHAPE.params == SHAPE.layer_params + 80
    assert SHAPE.kv_bytes_per_token() == 2 * 2 * 2 * 4 * 2


def test_a_scoring_pass_by_hand():
    # one device: 4 samples x 4 tokens; 2 x (weights + attention) FLOPs per token at 500 FLOP/s
    weights = SHAPE.layer_params + 80
    attention = 2 * 2 * 8 * 4
    expected = 2 * 16 * (weights + attention) / 500
    assert pass_seconds(SHAPE, ONE, WORK, CLUSTER, backward=False) == pytest.approx(expected)
    # two tensor-parallel ranks: half the decoder and attention each, plus 2 all-reduces per layer of (4, 4, 8) bf16
    split = 2 * 16 * (SHAPE.layer_params / 2 + 80 + attention / 2) / 500
    all_reduce = 0.01 + 4 * 4 * 8 * 2 * 2 * (1 / 2) / 50
    assert pass_seconds(SHAPE, LayoutShape(dp=1, t=2, tg=1), WORK, CLUSTER, backward=False) == pytest.approx(
        split + 2 * 2 * all_reduce
    )


def test_ulysses_by_hand():
    """sp = 2 on 2 devices (dp 1): each rank runs half the tokens, gathers the other half of the weights (FSDP over
    both) and sends half its slice of each activation in 4 all-to-alls per layer in a forward; a rank holds half the
    activations and logits."""
    weights, attention = SHAPE.layer_params + 80, 2 * 2 * 8 * 4
    sp2 = LayoutShape(dp=1, t=1, tg=1, sp=2)
    compute = 2 * 16 * (weights + attention) / 2 / 500
    gather = 2 * SHAPE.params * (1 / 2) / 50
    all_to_all = 0.01 + 4 * 4 * 8 * 2 / 2 * (1 / 2) / 50  # a rank's slice of (4, 4, 8) bf16, half of it sent
    expected = max(compute, gather) + 2 * 4 * all_to_all
    assert pass_seconds(SHAPE, sp2, WORK, CLUSTER, backward=False) == pytest.approx(expected)
    static, transient = memory_bytes(Role.Critic, SHAPE, sp2, WORK)
    one_static, one_transient = memory_bytes(Role.Critic, SHAPE, ONE, WORK)
    assert (static, transient) == pytest.approx((one_static / 2, one_transient / 2))


def test_generation_and_the_switch_by_hand():
    weights = SHAPE.layer_params + 80  # multiplied per token: the decoder and the LM head
    prefill = 2 * weights * 4 * 3 / 500
    read = 2 * weights + 4 * 3.5 * SHAPE.kv_bytes_per_token()
    step = max(read / 50, 2 * weights * 4 / 500)
    assert generation_seconds(SHAPE, ONE, WORK, CLUSTER) == pytest.approx(prefill + step)
    assert (
        switch_seconds(SHAPE, LayoutShape(dp=1, t=2, tg=2), CLUSTER) == 0.0
    )  # each rank's shard is its generation shard
    # t=2, tg=1: the other half of the bf16 decoder comes over the link
    assert switch_seconds(SHAPE, LayoutShape(dp=1, t=2, tg=1), CLUSTER) == pytest.approx(
        2 * SHAPE.layer_params / 2 / 50
    )


def test_the_fixed_cost_of_each_layer_call():
    slow = replace(CLUSTER, layer_overhead=0.001, decode_layer_overhead=0.001)
    base = pass_seconds(SHAPE, ONE, WORK, CLUSTER, backward=False)
    assert pass_seconds(SHAPE, ONE, WORK, slow, backward=False) == pytest.approx(base + 1 * 2 * 0.001)
    base = pass_seconds(SHAPE, ONE, WORK, CLUSTER, backward=True)
    assert pass_seconds(SHAPE, ONE, WORK, slow, backward=True) == pytest.approx(base + 3 * 2 * 0.001)
    base = generation_seconds(SHAPE, ONE, WORK, CLUSTER)  # a prefill and 1 decode step, 2 layers each
    assert generation_seconds(SHAPE, ONE, WORK, slow) == pytest.approx(base + 2 * 2 * 0.001)


def test_memory_by_hand():
    static, transient = memory_bytes(Role.ActorRollout, SHAPE, LayoutShape(dp=1, t=2, tg=2), WORK)
    assert static == pytest.approx(16 * SHAPE.params / 2 + 2 * (SHAPE.layer_params / 2 + 80))
    activations = 34 * 4 * 4 * 8 / 2 * 2 + 4 * 4 * 4 * 10  # a micro-batch of 4 samples x 4 tokens, 2 layers, t 2
    kv_cache = 4 * 4 * SHAPE.kv_bytes_per_token() / 2
    assert transient == pytest.approx(max(activations, kv_cache))
    ref_static, _ = memory_bytes(Role.RefPolicy, SHAPE, LayoutShape(dp=2, t=1, tg=1), WORK)
    assert ref_static == pytest.approx(4 * SHAPE.params / 2)


def test_lora_by_hand():
    # rank 2 on every projection of the 2 layers: q, k, v, o are 8 -> 8 (16 each), gate and up 8 -> 16 and down
    # 16 -> 8 (24 each): r x (inputs + outputs) each
    assert SHAPE.adapter_params(2) == 2 * 2 * (4 * 16 + 3 * 24)
    assert SHAPE.adapter_params(2, ("q_proj", "v_proj")) == 2 * 2 * (16 + 16)
    adapters = SHAPE.adapter_params(2)
    lora = replace(WORK, adapters={Role.ActorRollout: adapters})
    layout = LayoutShape(dp=2, t=1, tg=1)
    full, _ = memory_bytes(Role.ActorRollout, SHAPE, layout, WORK)
    static, _ = memory_bytes(Role.ActorRollout, SHAPE, layout, lora)
    generation_copy = 2 * (SHAPE.layer_params + 80)
    assert full == pytest.approx(16 * SHAPE.params / 2 + generation_copy)
    # the frozen base in bf16 with no gradients or optimizer state; 16 bytes per adapter weight
    assert static == pytest.approx((2 * SHAPE.params + 16 * adapters) / 2 + generation_copy)
    # the update's backward computes no weight gradients of the base: 4 x, not 6 x, the forward's FLOPs
    forward = pass_seconds(SHAPE, ONE, WORK, CLUSTER, backward=False)
    assert pass_seconds(SHAPE, ONE, lora, CLUSTER, backward=True, frozen_base=True) == pytest.approx(2 * forward)
    assert pass_seconds(SHAPE, ONE, WORK, CLUSTER, backward=True) == pytest.approx(3 * forward)


def test_hybridflow_plan_writes_a_config_that_train_accepts(arithmetic_files, tmp_path, capsys):
    train, _ = arithmetic_files
    settings = [
        f"data.train_files=[{train}]",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ]
    base = tmp_path / "base.yaml"
    base.write_text(
        "data:\n  train_batch_size: 4\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 4\n"
        "critic:\n  ppo_mini_batch_size: 4\n"
    )
    out = tmp_path / "plan.yaml"
    assert cli(["plan", "--config", str(base), "--cluster", "cpu", "--out", str(out), *settings]) == 0
    printed = capsys.readouterr().out
    assert "feasible plans on 2 x cpu" in printed and "s/step" in printed
    written = OmegaConf.to_container(OmegaConf.load(out))
    assert written["data"]["train_batch_size"] == 4  # the --config file's keys are kept
    assert written["trainer"]["placement"] == "custom"
    assert set(written["trainer"]["role_pool"]) == {"actor_rollout", "ref", "critic"}
    config = load_config(settings, out)
    check_config(config)  # validated like any config: the pools fit this machine, batches split over them
    assert sum(sum(nodes) for nodes in written["trainer"]["resource_pool_spec"].values()) == 2


def test_a_teacher_is_planned_as_a_scoring_role(arithmetic_files, tmp_path, capsys):
    """On-policy distillation: the teacher's pass costs what a frozen model's forward costs, in the phase of the old
    log-probs, and the plan gives it a pool that train accepts."""
    assert stage_seconds(Role.Teacher, SHAPE, ONE, WORK, CLUSTER) == {
        "teacher": pass_seconds(SHAPE, ONE, WORK, CLUSTER, backward=False)
    }
    assert memory_bytes(Role.Teacher, SHAPE, ONE, WORK)[0] == 4 * SHAPE.params  # fp32 weights, nothing trained
    train, _ = arithmetic_files
    settings = [f"data.train_files=[{train}]", "teacher.model.path=tiny-qwen2"]
    assert workload_from_config(load_config(settings)).models[Role.Teacher].name == "tiny-qwen2"
    out = tmp_path / "plan.yaml"
    assert cli(["plan", "--cluster", "cpu", "--out", str(out), *settings]) == 0
    written = OmegaConf.to_container(OmegaConf.load(out))
    assert set(written["trainer"]["role_pool"]) == {"actor_rollout", "teacher"}
    check_config(load_config(settings, out))


def test_plan_refuses_an_unknown_cluster(capsys):
    assert cli(["plan", "--cluster", "tpu-v9"]) == 2
    assert "no such preset" in capsys.readouterr().err


def test_one_step_off_overlaps_generation_with_the_rest_of_the_step_by_hand():
    from hybridflow.planner.cost import stage_seconds, transfer_seconds
    from hybridflow.planner.search import evaluate_set, step_plan

    work = WORK.in_mode("one_step_off")
    assert work.rollout_apart and set(work.models) == {Role.ActorRollout, Role.Rollout}
    actor = evaluate_set(work, CLUSTER, {Role.ActorRollout: ONE})
    rollout = evaluate_set(work, CLUSTER, {Role.Rollout: ONE})
    assert "gen" not in actor.stage_seconds  # the actor only trains
    generation = generation_seconds(SHAPE, ONE, work, CLUSTER)
    assert rollout.stage_seconds == {"gen": generation, "weight_transfer": transfer_seconds(SHAPE, ONE, CLUSTER)}
    # the rollout rank receives the whole bf16 model (tg = 1) over the link
    assert transfer_seconds(SHAPE, ONE, CLUSTER) == pytest.approx(2 * SHAPE.params / 50)
    # tg = 2: half of the decoder, the embedding whole
    assert transfer_seconds(SHAPE, LayoutShape(dp=1, t=2, tg=2), CLUSTER) == pytest.approx(
        (2 * SHAPE.layer_params / 2 + 2 * 80) / 50
    )
    training = stage_seconds(Role.ActorRollout, SHAPE, ONE, work, CLUSTER)
    plan = step_plan([actor, rollout], overlapped=True)
    expected = max(generation, training["old_log_prob"] + training["update_actor"]) + 2 * SHAPE.params / 50
    assert plan.overlapped and plan.seconds == pytest.approx(expected)
    # the rollout's devices hold only the generation copy and its KV cache
    held, kv = memory_bytes(Role.Rollout, SHAPE, ONE, work)
    assert held == pytest.approx(2 * SHAPE.params) and kv == pytest.approx(4 * 4 * SHAPE.kv_bytes_per_token())
    assert WORK.in_mode("sync") == WORK and not step_plan([actor], overlapped=False).overlapped


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_plan_of_an_asynchronous_config_keeps_the_rollout_apart_and_says_whether_it_pays(
    arithmetic_files, tmp_path, capsys, mode
):
    train, _ = arithmetic_files
    settings = [
        f"data.train_files=[{train}]",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"trainer.async_training.mode={mode}",
        "algorithm.rollout_correction.rollout_is=token",
    ]  # the placement is the plan's (all_colocate, the default, could not overlap anything)
    out = tmp_path / "plan.yaml"
    assert cli(["plan", "--cluster", "cpu", "--out", str(out), *settings]) == 0
    printed = capsys.readouterr().out
    assert "one step off policy (trainer.async_training.mode=one_step_off)" in printed
    assert ("does not pay here" in printed) != (" pays here" in printed)
    written = OmegaConf.to_container(OmegaConf.load(out))
    trainer = written["trainer"]
    assert trainer["async_training"]["mode"] == mode  # the config's asynchronous mode, kept
    assert trainer["role_pool"]["rollout"] != trainer["role_pool"]["actor_rollout"]  # never on the actor's devices
    check_config(load_config(settings, out))  # trainable as written


def test_plan_writes_the_stages_it_chooses_and_train_accepts_them(arithmetic_files, tmp_path, capsys, monkeypatch):
    """A 2-device machine whose link is slow next to its compute: the tiny actor's weights cost more to gather (data
    parallelism) than its short micro-batches' activations to send between 2 stages of one layer each, so the plan
    splits the layers, and the written config passes the run plan (2 micro-batches of 16 of the 32 rows a step)."""
    import hybridflow.planner.command as command
    from hybridflow.planner.cluster import PRESETS
    from hybridflow.trainer.setup.run_plan import make_run_plan

    slow_link = replace(
        PRESETS["cpu"], flops=1e15, intra_node_bandwidth=1e7, inter_node_bandwidth=1e7, collective_latency=1e-6
    )
    monkeypatch.setattr(command, "cluster_preset", lambda name, nodes=1: slow_link.with_nodes(nodes))
    train, _ = arithmetic_files
    settings = [
        f"data.train_files=[{train}]",
        "data.max_prompt_length=16",
        "actor_rollout_ref.rollout.response_length=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    ]
    out = tmp_path / "plan.yaml"
    assert cli(["plan", "--cluster", "cpu", "--out", str(out), *settings]) == 0
    assert "actor_rollout 1/1 pp2" in capsys.readouterr().out
    written = OmegaConf.to_container(OmegaConf.load(out))
    actor = written["actor_rollout_ref"]["actor"]
    assert actor["pipeline_model_parallel_size"] == 2 and actor["virtual_pipeline_model_parallel_size"] == 1
    config = load_config(settings, out)
    check_config(config)
    layout = make_run_plan(config).layouts[Role.ActorRollout]
    assert (layout.dp, layout.pp, layout.t) == (1, 2, 1)
    assert workload_from_config(config).optimizer_steps == 1  # data.train_batch_size 8 = ppo_mini_batch_size 8


def test_plan_writes_only_the_sizes_a_section_has(tmp_path):
    """The reward model's section has sequence-parallel and pipeline sizes alone (no tensor-parallel layers, no
    interleaved stages, no split experts): the plan writes no other size there, and the config loads."""
    from hybridflow.planner.command import plan_overrides
    from hybridflow.planner.search import DeviceSet, Plan

    layouts = {Role.ActorRollout: LayoutShape(dp=1, t=1, tg=1, pp=2), Role.RewardModel: LayoutShape(dp=2, t=1, tg=1)}
    plan = Plan((DeviceSet(tuple(layouts), 2, layouts, {}),), 0.0, ())
    overrides = plan_overrides(plan, replace(CLUSTER, devices_per_node=2))
    assert overrides["reward_model"] == {"ulysses_sequence_parallel_size": 1, "pipeline_model_parallel_size": 1}
    assert overrides["actor_rollout_ref"]["actor"] == {
        "tensor_model_parallel_size": 1,
        "ulysses_sequence_parallel_size": 1,
        "pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": 1,
    }
    out = tmp_path / "plan.yaml"
    out.write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    assert load_config([], out).actor_rollout_ref.actor.pipeline_model_parallel_size == 2


def test_the_critic_runs_its_own_micro_batches_and_optimizer_steps():
    config = load_config(
        [
            "algorithm.adv_estimator=gae",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "critic.ppo_mini_batch_size=2",
            "critic.ppo_micro_batch_size_per_gpu=1",
        ]
    )
    workload = workload_from_config(config)
    assert (workload.micro_batch, workload.optimizer_steps) == (16, 1)
    critic = workload.for_role(Role.Critic)
    assert (critic.micro_batch, critic.optimizer_steps) == (1, 4)
    assert workload.for_role(Role.RefPolicy) is workload
