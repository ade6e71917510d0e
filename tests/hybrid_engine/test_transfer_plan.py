"""The actor-to-rollout transfer plan, pure: pieces and buckets against hand-computed values, and a
simulated transfer that rebuilds every generation shard exactly once from the training shards."""

import itertools

import pytest
import torch

from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.transfer_plan import (
    ParamSpec,
    plan_transfer,
    predicted_sent_bytes,
    predicted_transfer_bytes,
    transfer_params,
)
from hybridflow.models import load_causal_lm, resolve_model_path

# 2-byte elements (bf16): 64 bytes each
PARAMS = [ParamSpec("embed", (8, 4), None), ParamSpec("q", (8, 4), 0), ParamSpec("o", (4, 8), 1)]
SPLIT_BYTES, WHOLE_BYTES = 128, 64


def plan(dp: int, t: int, replicas: int, tg: int, params=PARAMS, bucket_bytes: int = 1 << 20, element_size: int = 2):
    return plan_transfer(
        LayoutShape(dp=dp, t=t, tg=1),
        replicas=replicas,
        tg=tg,
        params=params,
        element_size=element_size,
        bucket_bytes=bucket_bytes,
    )


def summary(bucket) -> tuple:
    """(sender, receiver, index, [(name, source, target, length, shape, offset)])"""
    pieces = [(p.name, p.source, p.target, p.length, p.shape, p.offset) for p in bucket.pieces]
    return bucket.sender, bucket.receiver, bucket.index, pieces


def test_t2_to_tg1_each_training_shard_fills_half_of_the_one_generation_shard():
    got = plan(dp=1, t=2, replicas=1, tg=1)
    assert [summary(b) for b in got.buckets] == [
        (0, 0, 0, [("embed", 0, 0, 0, (8, 4), 0), ("q", 0, 0, 4, (4, 4), 32), ("o", 0, 0, 4, (4, 4), 48)]),
        (1, 0, 0, [("q", 0, 4, 4, (4, 4), 0), ("o", 0, 4, 4, (4, 4), 16)]),
    ]
    assert [b.nbytes for b in got.buckets] == [128, 64]
    assert got.received_bytes(0) == 192 == predicted_transfer_bytes(SPLIT_BYTES, WHOLE_BYTES, 1)
    assert (got.sent_bytes(0), got.sent_bytes(1)) == (128, 64)
    assert got.split_and_whole_bytes() == (SPLIT_BYTES, WHOLE_BYTES)
    # the unsplit weight comes from tp index 0: the dp group of tp index 1 does not gather it
    assert [got.needs_unshard(0, i) for i in (0, 1)] == [True, False]
    assert all(got.needs_unshard(p, i) for p in (1, 2) for i in (0, 1))


def test_t1_to_tg2_one_actor_rank_sends_each_half_and_the_unsplit_weight_twice():
    got = plan(dp=1, t=1, replicas=1, tg=2)
    assert [summary(b) for b in got.buckets] == [
        (0, 0, 0, [("embed", 0, 0, 0, (8, 4), 0), ("q", 0, 0, 4, (4, 4), 32), ("o", 0, 0, 4, (4, 4), 48)]),
        (0, 1, 0, [("embed", 0, 0, 0, (8, 4), 0), ("q", 4, 0, 4, (4, 4), 32), ("o", 4, 0, 4, (4, 4), 48)]),
    ]
    assert got.received_bytes(0) == got.received_bytes(1) == 128 == predicted_transfer_bytes(128, 64, 2)
    assert got.sent_bytes(0) == 256 == predicted_sent_bytes(128, 64, dp=1, t=1, replicas=1, tg=2, actor_rank=0)
    assert got.generation_shape(1) == (4, 4) and got.generation_shape(2) == (4, 4)
    assert got.generation_shape(0) == (8, 4)


def test_t2_to_tg2_each_rank_sends_its_own_shard_to_its_twin():
    got = plan(dp=1, t=2, replicas=1, tg=2)
    assert [summary(b) for b in got.buckets] == [
        (0, 0, 0, [("embed", 0, 0, 0, (8, 4), 0), ("q", 0, 0, 4, (4, 4), 32), ("o", 0, 0, 4, (4, 4), 48)]),
        (1, 1, 0, [("embed", 0, 0, 0, (8, 4), 0), ("q", 0, 0, 4, (4, 4), 32), ("o", 0, 0, 4, (4, 4), 48)]),
    ]


def test_replicas_are_spread_over_the_actor_dp_replicas():
    got = plan(dp=2, t=1, replicas=2, tg=1)
    assert [(b.sender, b.receiver) for b in got.buckets] == [(0, 0), (1, 1)]
    got = plan(dp=2, t=2, replicas=3, tg=1)  # replicas 0 and 2 from dp index 0 (ranks 0, 1), replica 1 from ranks 2, 3
    assert sorted({(b.sender, b.receiver) for b in got.buckets}) == [(0, 0), (0, 2), (1, 0), (1, 2), (2, 1), (3, 1)]
    for rank in range(4):
        assert got.sent_bytes(rank) == predicted_sent_bytes(
            SPLIT_BYTES, WHOLE_BYTES, dp=2, t=2, replicas=3, tg=1, actor_rank=rank
        )


def test_t3_to_tg2_pieces_are_the_overlaps():
    params = [ParamSpec("q", (6, 2), 0)]
    got = plan(dp=1, t=3, replicas=1, tg=2, params=params)
    # training shards [0,2) [2,4) [4,6); generation shards [0,3) [3,6)
    assert sorted(summary(b) for b in got.buckets) == [
        (0, 0, 0, [("q", 0, 0, 2, (2, 2), 0)]),
        (1, 0, 0, [("q", 0, 2, 1, (1, 2), 0)]),
        (1, 1, 0, [("q", 1, 0, 1, (1, 2), 0)]),
        (2, 1, 0, [("q", 0, 1, 2, (2, 2), 0)]),
    ]


def test_buckets_hold_at_most_bucket_bytes_and_a_larger_piece_alone():
    got = plan(dp=1, t=2, replicas=1, tg=1, bucket_bytes=40)
    assert [(b.ready, b.sender, b.index, [p.name for p in b.pieces], b.nbytes) for b in got.buckets] == [
        (0, 0, 0, ["embed"], 64),  # larger than a bucket: alone
        (1, 0, 1, ["q"], 32),
        (1, 1, 0, ["q"], 32),
        (2, 0, 2, ["o"], 32),
        (2, 1, 1, ["o"], 32),
    ]
    got = plan(dp=1, t=2, replicas=1, tg=1, bucket_bytes=64)
    assert [(b.sender, b.index, [p.name for p in b.pieces], [p.offset for p in b.pieces]) for b in got.buckets] == [
        (0, 0, ["embed"], [0]),
        (0, 1, ["q", "o"], [0, 16]),
        (1, 0, ["q", "o"], [0, 16]),
    ]


def test_a_dimension_not_divisible_by_t_and_tg_is_refused_by_name():
    with pytest.raises(ValueError, match=r"q: dimension 0 of size 8 .* t=2 .* tg=3"):
        plan(dp=1, t=2, replicas=1, tg=3)


def simulate(got, params) -> None:
    """Every rollout rank's generation shards rebuilt from the training shards by the plan's pieces:
    equal to the slices of the full tensors, every element written exactly once, in bucket order."""
    full = {p.name: torch.arange(p.numel, dtype=torch.float64).view(p.shape) for p in params}
    for rank in range(got.rollouts):
        j = rank % got.tg
        shards = {i: torch.full(got.generation_shape(i), -1.0, dtype=torch.float64) for i in range(len(params))}
        writes = {i: torch.zeros(got.generation_shape(i)) for i in range(len(params))}
        indices: dict[int, list[int]] = {}
        for bucket in got.receives(rank):
            indices.setdefault(bucket.sender, []).append(bucket.index)
            assert bucket.nbytes <= got.bucket_bytes or len(bucket.pieces) == 1
            for piece in bucket.pieces:
                spec = params[piece.param]
                tp_index = bucket.sender % got.t
                if spec.dim is None:
                    shards[piece.param].copy_(full[spec.name])
                    writes[piece.param] += 1
                    assert tp_index == j % got.t
                    continue
                local = full[spec.name].chunk(got.t, dim=spec.dim)[tp_index]
                block = local.narrow(spec.dim, piece.source, piece.length)
                shards[piece.param].narrow(spec.dim, piece.target, piece.length).copy_(block)
                writes[piece.param].narrow(spec.dim, piece.target, piece.length).add_(1)
            assert bucket.sender // got.t == (rank // got.tg) % got.dp
        assert all(sorted(v) == v == list(range(len(v))) for v in indices.values())  # tags in order
        for i, spec in enumerate(params):
            expected = full[spec.name] if spec.dim is None else full[spec.name].chunk(got.tg, dim=spec.dim)[j]
            assert torch.equal(shards[i], expected), (spec.name, rank)
            assert torch.equal(writes[i], torch.ones_like(writes[i])), (spec.name, rank)  # exactly once
        split, whole = got.split_and_whole_bytes()
        assert got.received_bytes(rank) == predicted_transfer_bytes(split, whole, got.tg)
    for rank in range(got.actors):
        assert got.sent_bytes(rank) == predicted_sent_bytes(
            split, whole, dp=got.dp, t=got.t, replicas=got.replicas, tg=got.tg, actor_rank=rank
        )


@pytest.mark.parametrize("dp, t, replicas, tg", list(itertools.product([1, 2], [1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4])))
def test_every_generation_shard_is_covered_exactly_once(dp, t, replicas, tg):
    params = [ParamSpec("e", (12, 5), None), ParamSpec("c", (12, 6), 0), ParamSpec("r", (6, 12), 1)]
    got = plan(dp, t, replicas, tg, params=params, bucket_bytes=100, element_size=4)
    simulate(got, params)
    keys = [(b.ready, b.sender, b.receiver, b.index) for b in got.buckets]
    assert keys == sorted(keys)  # the one order both sides follow
    assert got == plan(dp, t, replicas, tg, params=params, bucket_bytes=100, element_size=4)


def test_the_parameter_list_of_a_qwen2_follows_the_family_table():
    model = load_causal_lm(str(resolve_model_path("tiny-qwen2", num_key_value_heads=4)), dtype=torch.float32)
    params = {p.name: p for p in transfer_params(model)}
    assert params["model.layers.0.self_attn.q_proj.weight"].dim == 0
    assert params["model.layers.0.self_attn.q_proj.bias"].dim == 0
    assert params["model.layers.0.self_attn.o_proj.weight"].dim == 1
    assert params["model.layers.0.mlp.down_proj.weight"].dim == 1
    assert params["model.embed_tokens.weight"].dim is None
    assert params["model.norm.weight"].dim is None
    assert params["model.embed_tokens.weight"].shape == tuple(model.model.embed_tokens.weight.shape)
