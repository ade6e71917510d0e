"""Pipeline stages in the cost model, by hand: 1F1B's bubble, a stage's compute, memory and traffic, the switch to
generation with every layer on every rank, and which layouts with stages are candidates."""

from dataclasses import replace

import pytest

from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.planner.cluster import cluster_preset
from hybridflow.planner.cost import (
    generation_seconds,
    layouts_for,
    memory_bytes,
    pass_seconds,
    pipeline_bubble,
    stages_filled,
    switch_seconds,
)
from hybridflow.planner.workload import ModelShape, Workload

SHAPE = ModelShape(name="m", layers=2, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=10, tied_embeddings=True)
CLUSTER = replace(
    cluster_preset("a100-80g"), flops=1000.0, train_efficiency=0.5, intra_node_bandwidth=50.0, collective_latency=0.01,
    layer_overhead=0.0, decode_layer_overhead=0.0,
)  # fmt: skip
# 4 samples of 4 tokens in micro-batches of one sample: 4 micro-batches on a rank that holds every row
WORK = Workload(models={Role.ActorRollout: SHAPE}, prompts=2, n=2, prompt_length=3, response_length=1, micro_batch=1)
ONE = LayoutShape(dp=1, t=1, tg=1)
STAGES = LayoutShape(dp=1, t=1, tg=1, pp=2)  # two ranks, one decoder layer each


def test_the_bubble_of_one_f_one_b_by_hand():
    assert pipeline_bubble(2, 2) == pytest.approx(1 / 3)  # 1 idle slot of 3
    assert pipeline_bubble(2, 4) == pytest.approx(1 / 5)
    assert pipeline_bubble(2, 8) == pytest.approx(1 / 9)
    assert pipeline_bubble(4, 4) == pytest.approx(3 / 7)
    assert [pipeline_bubble(1, m) for m in (1, 2, 8)] == [0.0, 0.0, 0.0]


def test_a_pass_over_two_stages_by_hand():
    """A rank runs one of the 2 layers and the LM head (the last stage), stretched by 5/4 (4 micro-batches, 2 stages),
    and sends each micro-batch's (1, 4, 8) bf16 activations over the one boundary (their gradients back too)."""
    stage_weights = SHAPE.layer_params / 2 + 80
    stage_attention = 2 * 1 * 8 * 4  # one layer's QK^T and AV per token
    send = 0.01 + 4 * 8 * 2 / 50
    forward = 2 * 16 * (stage_weights + stage_attention) / 500
    assert pass_seconds(SHAPE, STAGES, WORK, CLUSTER, backward=False) == pytest.approx(forward * 5 / 4 + 4 * send)
    update = 6 * 16 * (stage_weights + stage_attention) / 500
    assert pass_seconds(SHAPE, STAGES, WORK, CLUSTER, backward=True) == pytest.approx(update * 5 / 4 + 4 * 2 * send)
    # without stages: both layers, no bubble, nothing sent
    whole = 2 * 16 * (SHAPE.layer_params + 80 + 2 * 2 * 8 * 4) / 500
    assert pass_seconds(SHAPE, ONE, WORK, CLUSTER, backward=False) == pytest.approx(whole)


def test_an_update_fills_the_pipeline_once_per_optimizer_step():
    """Two optimizer steps of 2 samples each: each step's schedule has 2 micro-batches, so 1/3 of it idles."""
    two_steps = replace(WORK, optimizer_steps=2)
    stage = 6 * 16 * (SHAPE.layer_params / 2 + 80 + 2 * 8 * 4) / 500
    sends = 4 * 2 * (0.01 + 4 * 8 * 2 / 50)
    assert pass_seconds(SHAPE, STAGES, two_steps, CLUSTER, backward=True) == pytest.approx(stage * 3 / 2 + sends)
    # a scoring pass runs all 4 micro-batches in one schedule
    assert pass_seconds(SHAPE, STAGES, two_steps, CLUSTER, backward=False) == pytest.approx(
        pass_seconds(SHAPE, STAGES, WORK, CLUSTER, backward=False)
    )


def test_two_stages_halve_a_ranks_model_state_and_keep_two_micro_batches_in_flight():
    static, transient = memory_bytes(Role.Critic, SHAPE, STAGES, WORK)
    one_static, one_transient = memory_bytes(Role.Critic, SHAPE, ONE, WORK)
    assert static == pytest.approx(16 * SHAPE.params / 2) and one_static == pytest.approx(16 * SHAPE.params)
    # the first stage: 2 micro-batches of 4 tokens in flight, one layer each; the logits of one micro-batch
    assert transient == pytest.approx(2 * 34 * 4 * 8 * 1 + 4 * 4 * 10)
    assert one_transient == pytest.approx(1 * 34 * 4 * 8 * 2 + 4 * 4 * 10)
    checkpointed = replace(WORK, gradient_checkpointing=True)  # each in-flight micro-batch's layer inputs, bf16
    assert memory_bytes(Role.Critic, SHAPE, STAGES, checkpointed)[1] == pytest.approx(
        2 * 2 * 4 * 8 * 1 + 34 * 4 * 8 + 4 * 4 * 10
    )
    # the hybrid actor generates with every layer: its whole bf16 generation copy beside its half of the state
    actor_static, _ = memory_bytes(Role.ActorRollout, SHAPE, STAGES, WORK)
    assert actor_static == pytest.approx(16 * SHAPE.params / 2 + 2 * (SHAPE.layer_params + 80))


def test_the_switch_with_stages_brings_the_other_stages_generation_shards_by_hand():
    # 2 stages on 2 ranks (t = tg = 1, no FSDP peers): the own stage is already whole, the other stage comes whole
    assert switch_seconds(SHAPE, STAGES, CLUSTER) == pytest.approx(2 * SHAPE.params / 2 / 50)
    # dp 2 x pp 2 x t 2 generating with tg 1: the own stage's half (1312 bytes split, 80 whole) gathered over FSDP's 2
    # ranks (328 + 40) and its other tensor-parallel half (656), then the other stage's whole generation shard
    split, whole = 2 * SHAPE.layer_params, 2 * 80
    own_stage = split / 2 / 2 * (1 / 2) + split / 2 / 2 * (2 - 1) + whole / 2 * (1 / 2)
    other_stage = (split + whole) / 2
    layout = LayoutShape(dp=2, t=2, tg=1, pp=2)
    assert switch_seconds(SHAPE, layout, CLUSTER) == pytest.approx((own_stage + other_stage) / 50)
    assert own_stage + other_stage == 2416


def test_stages_are_candidates_where_the_layers_split_evenly_beside_each_tensor_and_ulysses_split():
    cluster = replace(cluster_preset("a100-80g"), devices_per_node=4)
    big = ModelShape(
        name="b", layers=16, hidden=1024, heads=16, kv_heads=8, ffn=4096, vocab=1000, tied_embeddings=False
    )

    def stages(shape: ModelShape, role: Role = Role.Critic) -> set[tuple[int, int]]:
        layouts = layouts_for(role, shape, 4, cluster)
        return {(layout.t, layout.pp) for layout in layouts if layout.pp > 1 and layout.sp == 1}

    assert stages(big) == {(1, 2), (1, 4), (2, 2)}
    assert stages(replace(big, layers=6)) == {(1, 2), (2, 2)}  # 4 stages do not split 6 layers
    ulysses = {(lay.sp, lay.pp) for lay in layouts_for(Role.Critic, big, 4, cluster) if lay.pp > 1 and lay.sp > 1}
    assert ulysses == {(2, 2)}  # 2 stages whose 2 sp ranks split each micro-batch's tokens
    assert stages(replace(big, layers=5)) == set()
    assert stages(big, Role.RewardModel) == set() and stages(big, Role.Rollout) == set()
    pipelined = [layout for layout in layouts_for(Role.ActorRollout, big, 4, cluster) if layout.pp > 1]
    assert {(layout.t, layout.tg, layout.pp) for layout in pipelined} == {(1, 1, 2), (1, 1, 4), (2, 1, 2), (2, 2, 2)}
    # without stages, the candidates are those of before: every (t, sp) in a node, each with its tg
    assert len(layouts_for(Role.ActorRollout, big, 4, cluster)) == len(pipelined) + 10


def test_a_layout_whose_schedules_leave_a_stage_idle_is_no_candidate():
    """The run plan refuses an optimizer step with fewer micro-batches than stages, each role's own (the critic's
    section has its micro-batch and mini-batch)."""
    assert stages_filled(Role.Critic, STAGES, WORK)  # 4 micro-batches per step on 2 stages
    assert stages_filled(Role.Critic, STAGES, replace(WORK, micro_batch=2))  # 2 of 2 rows
    assert not stages_filled(Role.Critic, STAGES, replace(WORK, micro_batch=4))  # 1 of 4 rows
    assert not stages_filled(Role.Critic, STAGES, replace(WORK, optimizer_steps=4))  # 1 row per step
    assert not stages_filled(Role.Critic, LayoutShape(dp=1, t=1, tg=1, pp=8), WORK)
    assert stages_filled(Role.ActorRollout, STAGES, WORK)
    # an actor in stages sends its weights to a rollout role apart (hybrid_engine/transfer_plan.py)
    assert stages_filled(Role.ActorRollout, STAGES, WORK.in_mode("one_step_off"))
    # the critic's own batch: its micro-batch of 4 leaves a stage idle where the actor's of 1 does not, and back
    assert not stages_filled(Role.Critic, STAGES, replace(WORK, critic_micro_batch=4))
    assert stages_filled(Role.ActorRollout, STAGES, replace(WORK, critic_micro_batch=4))
    assert stages_filled(Role.Critic, STAGES, replace(WORK, micro_batch=4, critic_micro_batch=1))
    assert not stages_filled(Role.Critic, STAGES, replace(WORK, critic_optimizer_steps=4))


GENERATION_STAGES = LayoutShape(dp=1, t=1, tg=1, pp=2, pg=2)  # the 2 training stages generate as 2 stages too


def test_generation_stages_hold_half_the_layers_and_one_cache_by_hand():
    """pg = 2: each rank's bf16 generation copy holds its stage's layer (half the decoder) and the embeddings; one
    group of 2 ranks runs all 4 samples, each rank caching its layer's keys and values of them."""
    static, transient = memory_bytes(Role.ActorRollout, SHAPE, GENERATION_STAGES, WORK)
    assert static == pytest.approx(16 * SHAPE.params / 2 + 2 * (SHAPE.layer_params / 2 + 80))
    kv_cache = 4 * (3 + 1) * SHAPE.kv_bytes_per_token() / 2  # 4 samples of 4 tokens, half the layers
    assert transient == pytest.approx(max(memory_bytes(Role.ActorRollout, SHAPE, STAGES, WORK)[1], kv_cache))


def test_the_switch_to_generation_stages_brings_only_the_embeddings_by_hand():
    # pp = pg = 2 on 2 ranks: a rank's own stage is its generation stage; only the other stage's share of the
    # embeddings (counted evenly over the stages) comes, not its layer
    assert switch_seconds(SHAPE, GENERATION_STAGES, CLUSTER) == pytest.approx(2 * 80 / 2 / 50)
    # pp 4, pg 2 (4 ranks): the other stage of the rank's generation stage, a quarter of the layers, and 3 quarters
    # of the embeddings
    four = LayoutShape(dp=1, t=1, tg=1, pp=4, pg=2)
    assert switch_seconds(SHAPE, four, CLUSTER) == pytest.approx((2 * SHAPE.layer_params / 4 + 3 * 2 * 80 / 4) / 50)


def test_generation_stages_take_one_group_the_time_of_two_by_hand():
    """pg = 2 on 2 ranks: one group generates the 4 samples at the time per step of one rank with every layer, plus
    2 sends of the hidden states a step; pg = 1: 2 groups of 2 samples at once."""
    fast = replace(CLUSTER, memory_bandwidth=1e12, decode_efficiency=1.0)  # compute-bound, to count by hand
    rate = fast.flops * fast.train_efficiency
    weights = SHAPE.layer_params + SHAPE.vocab * SHAPE.hidden

    def by_hand(batch: int, sends: float) -> float:
        prefill = 2 * weights * batch * 3 / rate
        return prefill + 1 * (2 * weights * batch / rate + sends)

    hidden = 4 * SHAPE.hidden * 2
    staged = generation_seconds(SHAPE, GENERATION_STAGES, WORK, fast)
    assert staged == pytest.approx(by_hand(4, 2 * (fast.collective_latency + hidden / fast.link_bandwidth(2))))
    assert generation_seconds(SHAPE, STAGES, WORK, fast) == pytest.approx(by_hand(2, 0.0))


def test_the_actor_generates_in_stages_of_every_divisor_of_its_training_stages():
    cluster = replace(cluster_preset("a100-80g"), devices_per_node=4)
    big = ModelShape(
        name="b", layers=16, hidden=1024, heads=16, kv_heads=8, ffn=4096, vocab=1000, tied_embeddings=False
    )
    actor = {(lay.t, lay.pp, lay.pg) for lay in layouts_for(Role.ActorRollout, big, 4, cluster) if lay.tg == 1}
    assert {(pp, pg) for t, pp, pg in actor if t == 1} == {(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)}
    assert all(lay.pg == 1 for lay in layouts_for(Role.Critic, big, 4, cluster))
