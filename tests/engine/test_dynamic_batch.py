"""Micro-batches by token count, the same update as fixed micro-batches, and balancing over ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.batch_keys import ADVANTAGES, METRICS, OLD_LOG_PROBS, RETURNS, VALUES
from hybridflow.engine.config import CriticConfig
from hybridflow.engine.critic import CriticEngine
from hybridflow.engine.dynamic_batch import group_by_tokens, micro_batch_groups
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.policy import PolicyEngine
from hybridflow.lengths import PromptSharing, packed_lengths, row_lengths
from hybridflow.models import load_causal_lm, load_critic
from hybridflow.trainer.setup.config import load_config

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


def test_fixed_groups_keep_the_rows_of_a_prompt_together():
    # a shuffled mini-batch: prompts 0 (rows 0, 2, 5), 1 (rows 1, 4), 3 (rows 3, 6) and 7
    sharing = PromptSharing(leaders=[0, 1, 0, 3, 1, 0, 3, 7], computed=[9, 9, 2, 9, 2, 2, 2, 9])
    groups = micro_batch_groups([9] * 8, micro_batch_size=3, max_tokens=None, sharing=sharing)
    assert groups == [[0, 2, 5], [1, 3, 4], [6, 7]]  # each in batch order
    grouped = PromptSharing(leaders=[0, 0, 2, 2, 4], computed=[9, 2, 9, 2, 9])  # as a rollout gives them
    assert micro_batch_groups([9] * 5, 2, None, grouped) == micro_batch_groups([9] * 5, 2, None)
    assert micro_batch_groups([9] * 8, 8, None, sharing) == [list(range(8))]  # one micro-batch: as it was


def test_token_groups_keep_the_rows_of_a_prompt_together():
    # prompt A (6 tokens) in rows 0, 2, 5; prompt B (8 tokens) in rows 1, 3; row 4 alone
    lengths = [10, 12, 9, 13, 20, 11]
    sharing = PromptSharing(leaders=[0, 1, 0, 1, 4, 0], computed=[10, 12, 3, 5, 20, 5])  # A: 18, B: 17 tokens
    assert group_by_tokens(lengths, 25, sharing=sharing) == [[4], [5, 0, 2], [3, 1]]  # rows longest first
    assert group_by_tokens(lengths, 40, sharing=sharing) == [[4, 5, 0, 2], [3, 1]]  # 20 + 18, then 17
    # A and B are over a budget of 15: their rows go one by one, at their full lengths (13, 12, 11, 10, 9)
    assert group_by_tokens(lengths, 15, sharing=sharing) == [[4], [3], [1], [5], [0], [2]]
    # more groups: the one with most rows is halved by prompts, then a single prompt's by rows
    assert group_by_tokens(lengths, 40, min_groups=3, sharing=sharing) == [[4], [5, 0, 2], [3, 1]]
    assert group_by_tokens(lengths, 40, min_groups=4, sharing=sharing) == [[4], [5, 0], [2], [3, 1]]


def test_units_are_never_split_over_micro_batches():
    """Preference pairs (rows 2k, 2k+1): fixed-size micro-batches take whole pairs, token groups keep a pair whole
    even over the budget, and a rank that cannot make enough micro-batches without splitting one says so."""
    pairs = [0, 0, 1, 1, 2, 2]
    assert micro_batch_groups([5] * 6, micro_batch_size=3, max_tokens=None, units=pairs) == [[0, 1], [2, 3], [4, 5]]
    assert micro_batch_groups([5] * 6, micro_batch_size=4, max_tokens=None, units=pairs) == [[0, 1, 2, 3], [4, 5]]
    assert micro_batch_groups([5] * 6, micro_batch_size=1, max_tokens=None, units=pairs) == [[0, 1], [2, 3], [4, 5]]
    lengths = [10, 12, 30, 25, 4, 6]  # pairs of 22, 55 and 10 tokens
    # 55 alone, 22 + 10; a group's rows in batch order, so a pair stays (chosen, rejected)
    assert group_by_tokens(lengths, 35, units=pairs) == [[2, 3], [0, 1, 4, 5]]
    assert group_by_tokens(lengths, 30, units=pairs) == [[2, 3], [0, 1], [4, 5]]  # 22 + 10 is over 30
    assert group_by_tokens(lengths, 35, min_groups=3, units=pairs) == [[2, 3], [0, 1], [4, 5]]
    with pytest.raises(ValueError, match="without splitting a unit"):
        group_by_tokens(lengths, 35, min_groups=4, units=pairs)


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
    engine = PolicyEngine(TrainedModel.build(model, config.actor.optim, 10), config.actor)
    data = batch.select(deepcopy=True)
    data.batch[OLD_LOG_PROBS] = engine.compute_log_prob(data, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
    metrics = engine.update_policy(data, mini_batch_size=len(data), temperature=1.0, seed=0).meta_info[METRICS]
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


def _train_critic(config: CriticConfig, batch):
    torch.manual_seed(0)
    critic = load_critic(config.model.path, dtype=torch.float32)
    torch.nn.init.normal_(critic.score.weight, std=0.1)  # not the zero head: the backbone gets gradients too
    initial = {name: p.detach().clone() for name, p in critic.named_parameters()}
    engine = CriticEngine(TrainedModel.build(critic, config.optim, 10), config)
    data = batch.select(deepcopy=True)
    values = engine.compute_values(data)
    data.batch[VALUES] = values.batch[VALUES]
    data.batch[RETURNS] = data.batch[VALUES] + data.batch[ADVANTAGES]
    metrics = engine.update_critic(data, mini_batch_size=len(data), seed=0).meta_info[METRICS]
    assert metrics["perf/mfu_critic_update"] > 0 and values.meta_info[METRICS]["perf/mfu_values"] > 0
    return data.batch[VALUES], {name: p.detach() - initial[name] for name, p in critic.named_parameters()}


def test_critic_with_packing_and_token_micro_batches_equals_padded_fixed(tiny_path, rollout_batch):
    budget = max(row_lengths(rollout_batch)) + min(row_lengths(rollout_batch))
    common = [
        f"critic.model.path={tiny_path}",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.shuffle=false",
        "critic.grad_clip=1000.0",
        f"critic.optim.lr={LR}",
        "critic.optim.eps=1.0",
        "critic.optim.weight_decay=0.0",
    ]
    fixed_values, fixed_step = _train_critic(
        load_config([*common, "critic.use_remove_padding=false"]).critic, rollout_batch
    )
    dynamic = [
        "critic.use_dynamic_bsz=true",
        f"critic.ppo_max_token_len_per_gpu={budget}",
        f"critic.forward_max_token_len_per_gpu={budget}",
    ]
    dynamic_values, dynamic_step = _train_critic(load_config([*common, *dynamic]).critic, rollout_batch)
    assert torch.allclose(dynamic_values, fixed_values, atol=1e-6)
    for name, step in fixed_step.items():
        assert step.abs().max() > 0, name
        assert torch.allclose(dynamic_step[name], step, rtol=1e-3, atol=1e-8), name


def _update_counting_tokens(config, batch):
    """One PPO step of a fresh tiny model without FSDP: its weights, and the tokens each forward computed."""
    model = load_causal_lm(config.model.path, dtype=torch.float32)
    engine = PolicyEngine(TrainedModel.build(model, config.actor.optim, 10), config.actor)
    data = batch.select(deepcopy=True)
    data.batch[OLD_LOG_PROBS] = engine.compute_log_prob(data, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
    tokens: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: tokens.append(args[0].numel()))
    engine.update_policy(data, mini_batch_size=len(data), temperature=1.0, seed=0)
    hook.remove()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, tokens


def test_shuffled_micro_batches_compute_each_prompt_once_and_give_the_same_update(
    tiny_path, rollout_batch, actor_config_factory
):
    # three prompts with two samples each (the second one's response shorter), in the order a rollout gives
    batch = rollout_batch[[0, 0, 1, 1, 3, 3]]
    batch.batch["response_mask"][1::2, 2:] = 0
    batch.batch["advantages"] = torch.linspace(-1.0, 1.0, 30).view(6, 5) * batch.batch["response_mask"]
    computed = sum(packed_lengths(batch))  # each prompt once
    assert computed < sum(row_lengths(batch))
    shuffled = "actor_rollout_ref.actor.shuffle=true"
    whole, whole_tokens = _update_counting_tokens(
        actor_config_factory(tiny_path, LR, shuffled, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6"), batch
    )
    split, split_tokens = _update_counting_tokens(actor_config_factory(tiny_path, LR, shuffled), batch)  # 2 rows
    # the update shuffles its rows (seed 0 puts every prompt's two samples apart); its 3 micro-batches
    # each hold one prompt's two samples, so no prompt is computed twice
    assert whole_tokens == [computed] and len(split_tokens) == 3 and sum(split_tokens) == computed
    for name, tensor in whole.items():
        scale = tensor.abs().max()
        assert (split[name] - tensor).abs().max() <= 1e-5 * scale, name
