"""The FSDP2 actor over 2 Ray ranks against the same model unsharded in this process, and against itself on 1 rank."""

import pytest
import torch

from hybridflow.algorithms.aggregation import AGG_MODES
from hybridflow.batch_keys import METRICS, OLD_LOG_PROBS
from hybridflow.controller import RayResourcePool, RayWorkerGroup
from hybridflow.lengths import row_lengths
from hybridflow.models import load_causal_lm
from hybridflow.protocol import DataProto

LR = 1e-2


def reference_log_probs(model, batch: DataProto) -> torch.Tensor:
    b = batch.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    response_length = b["responses"].shape[1]
    return (
        torch.log_softmax(logits[:, -response_length - 1 : -1].float(), -1)
        .gather(-1, b["responses"].unsqueeze(-1))
        .squeeze(-1)
    )


def test_sharded_log_probs_and_one_update_match_the_unsharded_model(
    local_ray, tiny_path, rollout_batch, actor_config_factory, actor_worker_factory
):
    pool = RayResourcePool([2])
    # 3 rows per rank with micro-batches of 2: accumulation over unequal micro-batches and ranks
    config = actor_config_factory(tiny_path, LR)
    group = RayWorkerGroup(pool, actor_worker_factory(config, 2))
    batch = rollout_batch.select(deepcopy=True)
    model = load_causal_lm(tiny_path, dtype=torch.float32)
    mask = batch.batch["response_mask"].float()

    sharded = group.compute_log_prob(batch).batch[OLD_LOG_PROBS]
    with torch.no_grad():
        expected = reference_log_probs(model, batch)
    assert torch.allclose(sharded * mask, expected * mask, atol=1e-5)

    # One PPO step with ratio 1 (old = current): loss = -sum(A * logp * mask) / sum(mask) over all 6 rows.
    batch.batch[OLD_LOG_PROBS] = sharded
    metrics = group.update_actor(batch).meta_info[METRICS]  # each metric's mean over the 2 ranks
    assert metrics["actor/skipped_steps"] == 0.0
    trained = group.full_state_dict()[0]
    pool.release()

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1.0, weight_decay=0.0)
    loss = -(batch.batch["advantages"] * reference_log_probs(model, batch) * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()
    # the reported loss is the whole mini-batch's, though computed in shares over 2 ranks x 2 micro-batches:
    # at ratio 1 the PPO loss value is -mean(A) over the response tokens (its gradient is that of -mean(A log p))
    reported = metrics["actor/pg_loss"]
    expected_loss = -(batch.batch["advantages"] * mask).sum() / mask.sum()
    assert abs(reported - expected_loss.item()) < 1e-5

    initial = load_causal_lm(tiny_path).state_dict()
    reference = dict(model.named_parameters())
    for name, tensor in trained.items():
        if name in reference:
            step_taken = tensor - initial[name]
            step_expected = reference[name].detach() - initial[name]
            assert step_expected.abs().max() > 0, name
            assert torch.allclose(step_taken, step_expected, rtol=1e-3, atol=1e-8), name


def _update_on(ranks: int, config, batch: DataProto, actor_worker_factory) -> tuple[dict, dict]:
    """One update_actor call of a fresh actor on ``ranks`` data-parallel ranks: its metrics and trained weights."""
    pool = RayResourcePool([ranks])
    group = RayWorkerGroup(pool, actor_worker_factory(config, ranks))
    try:
        metrics = group.update_actor(batch.select(deepcopy=True)).meta_info[METRICS]
        return metrics, group.full_state_dict()[0]
    finally:
        pool.release()


@pytest.mark.parametrize(
    "agg, batching",
    [(agg, "padded") for agg in AGG_MODES] + [("token-mean", "packed"), ("seq-mean-token-mean", "packed")],
)
def test_the_same_samples_on_one_or_two_ranks_give_the_same_loss_gradient_norm_and_weights(
    local_ray, tiny_path, rollout_batch, actor_config_factory, actor_worker_factory, agg, batching
):
    """How the rows of a mini-batch split over data-parallel ranks is not the update's business: 6 rows on one rank
    (micro-batches of 2, or of at most a token budget) and 3 on each of two (other micro-batches, other sums) give
    the same loss, gradient norm and weights, in every loss aggregation, over two epochs of shuffled micro-batches."""
    extra = [
        f"actor_rollout_ref.actor.loss_agg_mode={agg}",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.shuffle=true",
    ]
    if batching == "padded":
        extra.append("actor_rollout_ref.actor.use_remove_padding=false")
    else:  # packed rows in micro-batches of at most this many tokens: groups of one or two rows of mixed lengths
        budget = max(row_lengths(rollout_batch)) + min(row_lengths(rollout_batch))
        extra += [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        ]
    config = actor_config_factory(tiny_path, LR, *extra)
    batch = rollout_batch.select(deepcopy=True)
    with torch.no_grad():
        batch.batch[OLD_LOG_PROBS] = reference_log_probs(load_causal_lm(tiny_path, dtype=torch.float32), batch)

    one, one_weights = _update_on(1, config, batch, actor_worker_factory)
    two, two_weights = _update_on(2, config, batch, actor_worker_factory)
    assert one["actor/grad_norm"] > 0 and one["actor/pg_loss"] != 0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    initial = dict(load_causal_lm(tiny_path).named_parameters())
    for name, tensor in one_weights.items():
        if name not in initial:  # a buffer (RoPE's frequencies)
            continue
        step_one, step_two = tensor - initial[name], two_weights[name] - initial[name]
        assert step_one.abs().max() > 0, name
        assert torch.allclose(step_two, step_one, rtol=1e-4, atol=1e-8), name
