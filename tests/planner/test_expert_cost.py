"""Mixtures of experts in the planner, by hand: a mixture's shape counts every expert (memory, the switch) but
multiplies each token by k of them (compute); expert parallelism trades the experts' gathers for the tokens'
all-to-alls and the replicas' gradient sums; which layouts are candidates; and `hybridflow plan` writing an ep that
`hybridflow train` accepts."""

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.cli import main as cli
from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.planner.cluster import cluster_preset
from hybridflow.planner.cost import layouts_for, memory_bytes, pass_seconds, switch_bytes_received
from hybridflow.planner.workload import ModelShape, Workload, shape_from_hf
from hybridflow.trainer.setup.check_config import check_config
from hybridflow.trainer.setup.config import load_config

DENSE = ModelShape(name="d", layers=2, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=10, tied_embeddings=True)
MOE = replace(DENSE, name="m", experts=4, experts_per_token=2)
CLUSTER = replace(
    cluster_preset("a100-80g"), flops=1000.0, train_efficiency=0.5, intra_node_bandwidth=50.0, collective_latency=0.01,
    layer_overhead=0.0, decode_layer_overhead=0.0,
)  # fmt: skip
# 8 samples of 4 tokens in micro-batches of one sample
WORK = Workload(models={Role.ActorRollout: MOE}, prompts=4, n=2, prompt_length=3, response_length=1, micro_batch=1)


def test_a_mixtures_shape_counts_every_expert_and_multiplies_by_k():
    attention, mlp, norms, router = 8 * 24 + 64, 3 * 8 * 16, 16, 4 * 8
    assert DENSE.layer_params == 2 * (attention + mlp + norms)
    assert MOE.layer_params == 2 * (attention + 4 * mlp + router + norms)
    assert MOE.active_layer_params == 2 * (attention + 2 * mlp + router + norms)
    assert MOE.expert_params == 2 * 4 * mlp
    assert MOE.read_params(1) == MOE.layer_params - MOE.expert_params // 2  # one token reaches 2 of the 4 experts
    assert MOE.read_params(2) == MOE.layer_params  # two reach them all
    assert MOE.expert_splits(8) == [2, 4] and DENSE.expert_splits(8) == []
    assert MOE.splits_over(2) and not replace(MOE, experts=3).splits_over(2)  # whole experts on each of t ranks


def test_the_shape_of_a_hugging_face_mixture_counts_its_weights():
    path = resolve_model_path("tiny-mixtral")
    model = load_causal_lm(str(path), dtype=torch.float32)
    shape = shape_from_hf(model.config, "tiny-mixtral")
    assert (shape.experts, shape.experts_per_token) == (4, 2)
    assert shape.params + shape.hidden == sum(
        p.numel() for p in model.parameters()
    )  # the shape leaves out the final norm
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert shape.expert_params == experts


def test_expert_parallelism_by_hand():
    """2 ranks: with ep = 2 the experts are not gathered; each of a rank's 4 micro-batches sends its tokens' 2 copies
    to the other rank and back in both layers (4 all-to-alls a layer with the backward); no replicas, no sums."""
    whole, split = LayoutShape(dp=2, t=1, tg=1), LayoutShape(dp=2, t=1, tg=1, ep=2)
    compute = 6 * 4 * 4 * (MOE.active_layer_params + 80 + 2 * 2 * 8 * 4) / 500  # 4 rows of 4 tokens on a rank
    gather = 2 * MOE.params * (1 / 2) / 50
    assert pass_seconds(MOE, whole, WORK, CLUSTER, backward=True) == pytest.approx(max(compute, 3 * gather))
    exchange = 0.01 + 4 * 8 * 2 * 2 * (1 / 2) / 50  # a micro-batch's (1, 4, 8) bf16 activations x k, half sent
    gather = 2 * (MOE.params - MOE.expert_params) * (1 / 2) / 50
    expected = max(compute, 3 * gather) + 4 * (4 * 2 * exchange)
    assert pass_seconds(MOE, split, WORK, CLUSTER, backward=True) == pytest.approx(expected)
    # 4 ranks, ep = 2: two replicas of each half of the experts sum their fp32 gradients in every micro-batch
    replicas = LayoutShape(dp=4, t=1, tg=1, ep=2)
    rows = 2
    compute = 6 * rows * 4 * (MOE.active_layer_params + 80 + 2 * 2 * 8 * 4) / 500
    gather = 2 * (MOE.params - MOE.expert_params) * (3 / 4) / 50
    summed = 0.01 + 4 * MOE.expert_params / 2 * 2 * (1 / 2) / 50
    expected = max(compute, 3 * gather) + rows * (4 * 2 * exchange + summed)
    assert pass_seconds(MOE, replicas, WORK, CLUSTER, backward=True) == pytest.approx(expected)


def test_split_experts_in_memory_and_in_the_switch_by_hand():
    """4 ranks, ep = 2: a rank holds half of the experts (16 bytes a trained weight) and a quarter of the rest; the
    switch gathers the experts from the other half's rank (1/2 of them) and the rest over all 4 (3/4)."""
    layout = LayoutShape(dp=4, t=1, tg=1, ep=2)
    rest = MOE.params - MOE.expert_params
    static, _ = memory_bytes(Role.Critic, MOE, layout, replace(WORK, models={Role.Critic: MOE}))
    assert static == pytest.approx(16 * (rest / 4 + MOE.expert_params / 2))
    received = 2 * MOE.expert_params / 2 + 2 * (MOE.layer_params - MOE.expert_params) * 3 / 4 + 2 * 80 * 3 / 4
    assert switch_bytes_received(MOE, layout) == pytest.approx(received)
    no_split = 2 * MOE.params * 3 / 4
    assert switch_bytes_received(MOE, LayoutShape(dp=4, t=1, tg=1)) == pytest.approx(no_split)


def test_a_mixture_is_laid_out_with_its_experts_split_over_ep_or_t_or_whole_under_ulysses():
    """Data-parallel, its 4 experts split over 2 or 4 of the ranks where it trains, or between t = 2 ranks (its 2
    heads; the actor generating in groups of 1 or 2), or Ulysses over 2 with the experts whole; never in stages."""
    cluster = replace(CLUSTER, devices_per_node=8)
    trained = layouts_for(Role.ActorRollout, MOE, 8, cluster)
    expected = [(8, 1, 1, 1, 1, e) for e in (1, 2, 4)] + [(4, 2, tg, 1, 1, 1) for tg in (1, 2)] + [(4, 1, 1, 2, 1, 1)]
    assert [(lay.dp, lay.t, lay.tg, lay.sp, lay.pp, lay.ep) for lay in trained] == expected
    assert [(lay.t, lay.sp, lay.ep) for lay in layouts_for(Role.RefPolicy, MOE, 8, cluster)] == [
        (1, 1, 1),
        (2, 1, 1),
        (1, 2, 1),
    ]
    assert any(lay.t > 1 for lay in layouts_for(Role.ActorRollout, DENSE, 8, cluster))


def test_a_rollout_pool_splits_a_mixtures_experts_over_its_generation_groups():
    """The native engine's groups of tg ranks each hold E / tg whole experts: a rollout pool of 4 devices takes
    groups of 1 or 2 (2 heads: not 4), each rank holding 1/tg of the decoder, experts included, and 1/tg of the KV
    cache; a model whose 3 experts 2 does not divide stays in groups of 1."""
    cluster = replace(CLUSTER, devices_per_node=8)
    pools = layouts_for(Role.Rollout, MOE, 4, cluster)
    assert [(lay.dp, lay.t, lay.tg) for lay in pools] == [(4, 1, 1), (2, 2, 2)]
    assert [lay.tg for lay in layouts_for(Role.Rollout, replace(MOE, experts=3), 4, cluster)] == [1]
    apart = replace(WORK, models={Role.ActorRollout: MOE, Role.Rollout: MOE})
    (copy_1, kv_1), (copy_2, kv_2) = (memory_bytes(Role.Rollout, MOE, lay, apart) for lay in pools)
    assert copy_1 == 2 * (MOE.layer_params + MOE.embedding_params)  # every expert of every layer, bf16
    assert copy_2 == 2 * (MOE.layer_params / 2 + MOE.embedding_params)
    # 8 samples over 4 groups of 1 or 2 groups of 2: 2 or 4 sequences of 4 tokens, each 2 layers x 2 kv heads x 4 x
    # 2 values x 2 bytes, of which a rank of 2 holds half the heads
    assert kv_1 == 2 * 4 * 64 and kv_2 == 4 * 4 * 64 / 2


def test_hybridflow_plan_splits_the_experts_where_gathering_them_costs_more_and_train_accepts_it(
    arithmetic_files, tmp_path, capsys, monkeypatch
):
    """A 2-device machine whose link is slow next to its compute, and a tiny Qwen3-MoE with 32 wide experts (6 MB of
    bf16 experts beside 0.1 MB of embeddings): gathering the experts costs more than sending the micro-batches' tokens
    to them, so the plan splits the experts over both ranks."""
    import hybridflow.planner.command as command
    from hybridflow.planner.cluster import PRESETS
    from hybridflow.trainer.setup.run_plan import make_run_plan

    slow_link = replace(
        PRESETS["cpu"], flops=1e15, intra_node_bandwidth=1e7, inter_node_bandwidth=1e7, collective_latency=1e-6
    )
    monkeypatch.setattr(command, "cluster_preset", lambda name, nodes=1: slow_link.with_nodes(nodes))
    train, _ = arithmetic_files
    model = resolve_model_path("tiny-qwen3-moe", num_experts=32, moe_intermediate_size=256)
    settings = [f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}"]
    out = tmp_path / "plan.yaml"
    assert cli(["plan", "--cluster", "cpu", "--out", str(out), *settings]) == 0
    assert "actor_rollout 1/1 ep2" in capsys.readouterr().out
    written = OmegaConf.to_container(OmegaConf.load(out))
    assert written["actor_rollout_ref"]["actor"]["expert_model_parallel_size"] == 2
    config = load_config(settings, out)
    check_config(config)
    assert make_run_plan(config).layouts[Role.ActorRollout].ep == 2
