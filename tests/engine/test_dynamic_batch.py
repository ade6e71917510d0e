"""Micro-batches by token count, the same update as fixed micro-batches, and balancing over ranks."""

import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.engine.config import CriticConfig, ModelConfig, OptimConfig
from hybridflow.engine.critic import CriticEngine
from hybridflow.engine.dynamic_batch import balanced_order, group_by_tokens, micro_batch_groups, row_lengths
from hybridflow.engine.optim import build_lr_scheduler, build_optimizer
from hybridflow.engine.policy import PolicyEngine
from hybridflow.models import load_causal_lm, load_critic

LR = 1e-2


def test_token_groups_cover_every_row_once_within_the_budget():
    lengths = [5, 17, 3, 9, 12, 30, 1, 8, 8, 14]
    groups = group_by_tokens(lengths, max_tokens=20)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert sum(lengths[i] for i in group) <= 20 or len(group) == 1
    assert [5] in groups  # the 30-token row, over the budget, goes alone
    # first-fit decreasing: 30 | 17+3 | 14+5+1 | 12+8 | 9+8; the 77 tokens besides the 30 need >= 4 groups
    assert sorted(sorted(lengths[i] for i in g) for g in groups) == [[1, 5, 14], [3, 17], [8, 9], [8, 12], [30]]
    more = group_by_tokens(lengths, max_tokens=20, min_groups=9)  # another rank needs 9 micro-batches
    assert len(more) == 9 and sorted(i for g in more for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 20 or len(g) == 1 for g in more)


def test_fixed_groups_are_consecutive_rows():
    assert micro_batch_groups([4, 4, 4, 4, 4], micro_batch_size=2, max_tokens=None) == [[0, 1], [2, 3], [4]]


def _count_on_rank(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    lengths = [[10, 10, 10, 10], [40, 40, 40, 5]][rank]  # alone: 1 and 3 micro-batches of <= 45 tokens
    results[rank] = len(micro_batch_groups(lengths, micro_batch_size=1, max_tokens=45))
    dist.destroy_process_group()


def test_every_rank_runs_as_many_token_micro_batches(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_count_on_rank, args=(str(tmp_path / "init"), results), nprocs=2)
    assert dict(results) == {0: 3, 1: 3}


def _train(config, batch):
    """One PPO step of a fresh tiny model without FSDP; returns its weights."""
    model = load_causal_lm(config.model.path, dtype=torch.float32)
    optimizer = build_optimizer(model, config.actor.optim)
    engine = PolicyEngine(model, optimizer, build_lr_scheduler(optimizer, config.actor.optim, 10), config.actor)
    data = batch.select(deepcopy=True)
    data.batch["old_log_probs"], _ = engine.compute_log_prob(data, 1.0, with_entropy=False)
    metrics = engine.update_policy(data, mini_batch_size=len(data), temperature=1.0, seed=0)
    assert metrics["actor/skipped_steps"] == 0.0 and metrics["perf/mfu_update"] > 0
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_update_with_token_micro_batches_equals_fixed_micro_batches(
    tiny_path, rollout_batch, actor_config_factory, agg
):
    lengths = row_lengths(rollout_batch)
    budget = max(lengths) + min(lengths)  # groups of 1 or 2 rows of mixed lengths, unlike the fixed pairs
    assert micro_batch_groups(lengths, 2, budget) != micro_batch_groups(lengths, 2, None)
    common = (f"actor_rollout_ref.actor.loss_agg_mode={agg}",)
    fixed = _train(
        actor_config_factory(tiny_path, LR, *common, "actor_rollout_ref.actor.use_remove_padding=false"), rollout_batch
    )
    dynamic = _train(
        actor_config_factory(
            tiny_path,
            LR,
            *common,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
            f"actor_rollout_ref.actor.log_prob_max_token_len_per_gpu={budget}",
        ),
        rollout_batch,
    )
    # Both against an independent computation: the whole batch in one padded piece, one AdamW step.
    model = load_causal_lm(tiny_path, dtype=torch.float32)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    b = rollout_batch.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    response_length = b["responses"].shape[1]
    log_probs = (
        torch.log_softmax(logits[:, -response_length - 1 : -1], -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    )
    mask = b["response_mask"].float()
    per_token = -b["advantages"] * log_probs * mask  # ratio 1: the PPO loss is -A * logp in value and gradient
    if agg == "token-mean":
        loss = per_token.sum() / mask.sum()
    else:
        loss = (per_token.sum(-1) / response_length).sum() / (mask.sum(-1) > 0).sum()
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1.0, weight_decay=0.0).step()
    for name, p in model.named_parameters():
        expected = p.detach() - initial[name]
        assert expected.abs().max() > 0, name
        for trained in (fixed, dynamic):
            assert torch.allclose(trained[name] - initial[name], expected, rtol=1e-3, atol=1e-8), name


def _chunk_tokens(lengths: list[int], world_size: int) -> list[int]:
    chunk = len(lengths) // world_size
    return [sum(lengths[r * chunk : (r + 1) * chunk]) for r in range(world_size)]


def test_balanced_order_evens_out_the_ranks():
    lengths = list(range(100, 4, -6))  # 16 rows, longest first: the worst case for contiguous chunks
    order = balanced_order(lengths, 4)
    assert sorted(order) == list(range(16))
    before = _chunk_tokens(lengths, 4)
    after = _chunk_tokens([lengths[i] for i in order], 4)
    assert max(before) - min(before) == 4 * 4 * 6 * 3  # each chunk is 4 rows, 24 tokens shorter per row
    assert max(after) - min(after) <= 12
    assert sum(after) == sum(before)


def test_balanced_order_on_random_batches():
    rng = random.Random(0)
    for world_size in (2, 3, 8):
        lengths = [rng.randint(10, 500) for _ in range(world_size * 16)]
        order = balanced_order(lengths, world_size)
        assert sorted(order) == list(range(len(lengths)))
        tokens = _chunk_tokens([lengths[i] for i in order], world_size)
        assert max(tokens) - min(tokens) <= max(lengths)
        assert max(tokens) - min(tokens) < max(_chunk_tokens(lengths, world_size)) - min(
            _chunk_tokens(lengths, world_size)
        )
        chunk = len(lengths) // world_size
        assert all(
            order[r * chunk : (r + 1) * chunk] == sorted(order[r * chunk : (r + 1) * chunk]) for r in range(world_size)
        )


def _train_critic(config: CriticConfig, batch):
    torch.manual_seed(0)
    critic = load_critic(config.model.path, dtype=torch.float32)
    torch.nn.init.normal_(critic.score.weight, std=0.1)  # not the zero head: the backbone gets gradients too
    initial = {name: p.detach().clone() for name, p in critic.named_parameters()}
    optimizer = build_optimizer(critic, config.optim)
    engine = CriticEngine(critic, optimizer, build_lr_scheduler(optimizer, config.optim, 10), config)
    data = batch.select(deepcopy=True)
    data.batch["values"] = engine.compute_values(data)
    data.batch["returns"] = data.batch["values"] + data.batch["advantages"]
    metrics = engine.update_critic(data, mini_batch_size=len(data), seed=0)
    assert metrics["perf/mfu_critic_update"] > 0 and engine.values_metrics["perf/mfu_values"] > 0
    return data.batch["values"], {name: p.detach() - initial[name] for name, p in critic.named_parameters()}


def test_critic_with_packing_and_token_micro_batches_equals_padded_fixed(tiny_path, rollout_batch):
    budget = max(row_lengths(rollout_batch)) + min(row_lengths(rollout_batch))
    optim = OptimConfig(lr=LR, eps=1.0, weight_decay=0.0)
    common = dict(
        model=ModelConfig(path=tiny_path), ppo_micro_batch_size_per_gpu=2, shuffle=False, grad_clip=1000.0, optim=optim
    )
    fixed_values, fixed_step = _train_critic(CriticConfig(**common, use_remove_padding=False), rollout_batch)
    dynamic_values, dynamic_step = _train_critic(
        CriticConfig(
            **common, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget, forward_max_token_len_per_gpu=budget
        ),
        rollout_batch,
    )
    assert torch.allclose(dynamic_values, fixed_values, atol=1e-6)
    for name, step in fixed_step.items():
        assert step.abs().max() > 0, name
        assert torch.allclose(dynamic_step[name], step, rtol=1e-3, atol=1e-8), name


def test_balanced_order_keeps_each_group_on_one_rank():
    rng = random.Random(1)
    groups = [g for g in range(8) for _ in range(4)]  # 8 prompts x 4 samples, interleaved as the trainer repeats them
    lengths = [rng.randint(10, 200) for _ in groups]
    order = balanced_order(lengths, 2, groups=groups)
    assert sorted(order) == list(range(32))
    for rank in (0, 1):
        held = {groups[i] for i in order[rank * 16 : (rank + 1) * 16]}
        assert len(held) == 4  # four whole groups per rank
    tokens = _chunk_tokens([lengths[i] for i in order], 2)
    group_tokens = [sum(length for length, g in zip(lengths, groups) if g == k) for k in range(8)]
    assert max(tokens) - min(tokens) <= max(group_tokens)


def test_a_group_larger_than_a_rank_is_split_row_by_row():
    order = balanced_order([5, 4, 3, 2], 2, groups=["a", "a", "a", "b"])
    assert sorted(order) == [0, 1, 2, 3]
    assert _chunk_tokens([[5, 4, 3, 2][i] for i in order], 2) in ([7, 7], [8, 6], [6, 8])
