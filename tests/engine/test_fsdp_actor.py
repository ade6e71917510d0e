"""The FSDP2 actor over 2 Ray ranks against the same model unsharded in this process."""

import pytest
import ray
import torch

from hybridflow.controller import RayResourcePool, RayWorkerGroup, RoleSpec, start_ray
from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.hf_rollout import HFRollout
from hybridflow.trainer.config import load_config
from hybridflow.workers import ActorRolloutWorker

LR = 1e-2


@pytest.fixture(scope="module")
def setup():
    started = start_ray(num_cpus=8)
    path = str(resolve_model_path("tiny-llama"))
    config = load_config(
        [
            f"actor_rollout_ref.model.path={path}",
            "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=6",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # 3 rows per rank -> micro-batches of 2 and 1
            "actor_rollout_ref.actor.shuffle=false",
            f"actor_rollout_ref.actor.optim.lr={LR}",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "actor_rollout_ref.actor.optim.eps=1.0",  # update ~ lr * g: linear in the gradient, so comparable
            "actor_rollout_ref.actor.grad_clip=1000.0",
        ]
    ).actor_rollout_ref
    pool = RayResourcePool([2])
    group = RayWorkerGroup(pool, RoleSpec(ActorRolloutWorker, (config, 10, 0)))
    yield path, group
    group.kill()
    pool.release()
    if started:
        ray.shutdown()


def make_batch(path: str) -> DataProto:
    """Six prompt+response rows of different lengths from greedy generation of the same initial model."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(path)
    questions = ["1 + 1", "What is 12 times 3?", "hello", "Tell me 5 - 2", "9", "Add 7 and 8 and 100 please"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) for q in questions]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompts = DataProto.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "position_ids": (encoded["attention_mask"].cumsum(1) - 1).clamp(min=0)}
    )
    rollout = HFRollout(load_causal_lm(path, dtype=torch.float32), tokenizer)
    batch = rollout.generate_sequences(prompts, SamplingParams(False, 1.0, 1.0, -1, 5, 0))
    batch.batch["response_mask"][1, 3:] = 0  # responses of unequal lengths
    batch.batch["response_mask"][4, 1:] = 0
    return batch


def reference_log_probs(model, batch: DataProto) -> torch.Tensor:
    b = batch.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    response_length = b["responses"].shape[1]
    return torch.log_softmax(logits[:, -response_length - 1 : -1].float(), -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)


def test_sharded_log_probs_and_one_update_match_the_unsharded_model(setup):
    path, group = setup
    batch = make_batch(path)
    model = load_causal_lm(path, dtype=torch.float32)
    mask = batch.batch["response_mask"].float()

    sharded = group.compute_log_prob(batch).batch["old_log_probs"]
    with torch.no_grad():
        expected = reference_log_probs(model, batch)
    assert torch.allclose(sharded * mask, expected * mask, atol=1e-5)

    # One PPO step with ratio 1 (old = current): loss = -sum(A * logp * mask) / sum(mask) over all 6 rows.
    advantages = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape) * mask
    batch.batch["old_log_probs"] = sharded
    batch.batch["advantages"] = advantages
    metrics = group.update_actor(batch)
    assert all(m["actor/skipped_steps"] == 0.0 for m in metrics)

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1.0, weight_decay=0.0)
    loss = -(advantages * reference_log_probs(model, batch) * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()

    trained = group.full_state_dict()[0]
    reference = dict(model.named_parameters())
    initial = load_causal_lm(path).state_dict()
    for name, tensor in trained.items():
        if name in reference:
            step_taken = tensor - initial[name]
            step_expected = reference[name].detach() - initial[name]
            assert step_expected.abs().max() > 0, name
            assert torch.allclose(step_taken, step_expected, rtol=1e-3, atol=1e-8), name
