"""A LoRA actor over 2 Ray ranks (FSDP2) against peft's model in this process: the reference with the adapters
off, one update of the adapters only, the merged weights it exports and the generation engine's log-probs after
the switch."""

import pytest
import torch

from hybridflow.batch_keys import (
    GLOBAL_STEP,
    METRICS,
    OLD_LOG_PROBS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    SAMPLING,
)
from hybridflow.controller import RayResourcePool, RayWorkerGroup
from hybridflow.engine.lora import apply_lora
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.protocol import DataProto

LR = 1e-2
LORA = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8"]


def log_probs(model, batch: DataProto) -> torch.Tensor:
    b = batch.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    width = b["responses"].shape[1]
    chosen = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1)
    return chosen.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)


def peft_step(path: str, config, batch: DataProto, mask: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
    """One update of peft's model built as the actor builds it (seed 0, then the adapters), here: the merged weights
    after it (the plain model's names) and its adapters."""
    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(path, dtype=torch.float32), config.model.lora)
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=LR, betas=(0.9, 0.999), eps=1.0, weight_decay=0.0)
    loss = -(batch.batch["advantages"] * log_probs(model, batch) * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()
    return dict(model.merge_and_unload().named_parameters()), adapters


def switches_serve_the_trained_policy(group, batch: DataProto, prompts: DataProto) -> list[float]:
    """Two switches to generation, an update between them: each time the engine's log-probs of what it generated
    are the trainer's. The MB each switch synced."""
    synced = []
    for switch in range(2):
        if switch:
            batch.batch[OLD_LOG_PROBS] = group.compute_log_prob(batch).batch[OLD_LOG_PROBS]
            group.update_actor(batch)
        generated = group.generate_sequences(prompts)
        recomputed = group.compute_log_prob(generated).batch[OLD_LOG_PROBS]
        gen_mask = generated.batch[RESPONSE_MASK].float()
        torch.testing.assert_close(
            generated.batch[ROLLOUT_LOG_PROBS] * gen_mask, recomputed * gen_mask, atol=1e-4, rtol=0
        )
        synced.append(generated.meta_info[METRICS]["switch/generation_weights_mb"])
    return synced


def prompts_of(batch: DataProto) -> DataProto:
    width = batch.batch["prompts"].shape[1]
    prompts = DataProto.from_dict(
        {key: batch.batch[key][:, :width].clone() for key in ("input_ids", "attention_mask", "position_ids")}
    )
    prompts.meta_info.update({GLOBAL_STEP: 2, SAMPLING: "greedy"})
    return prompts


def test_a_lora_actor_trains_its_adapters_and_serves_the_merged_policy(
    local_ray, tiny_path, rollout_batch, actor_config_factory, actor_worker_factory
):
    config = actor_config_factory(tiny_path, LR, *LORA)
    pool = RayResourcePool([2])
    group = RayWorkerGroup(pool, actor_worker_factory(config, 2))
    batch = rollout_batch.select(deepcopy=True)
    mask = batch.batch[RESPONSE_MASK].float()
    base = load_causal_lm(tiny_path, dtype=torch.float32).eval()
    with torch.no_grad():
        base_log_probs = log_probs(base, batch)

    # the reference is the base model: the adapters off, on the actor's own ranks
    reference = group.compute_ref_log_prob(batch).batch[REF_LOG_PROB]
    torch.testing.assert_close(reference * mask, base_log_probs * mask, atol=1e-5, rtol=0)

    # one update of the adapters, against peft's model built the same way (seed 0, then the adapters) here
    batch.batch[OLD_LOG_PROBS] = group.compute_log_prob(batch).batch[OLD_LOG_PROBS]
    metrics = group.update_actor(batch).meta_info[METRICS]
    assert metrics["actor/skipped_steps"] == 0.0
    trained = group.full_state_dict()[0]
    expected, adapters = peft_step(tiny_path, config, batch, mask)
    initial = dict(base.named_parameters())
    assert set(trained) >= set(expected)  # the plain model's names: the adapters merged in
    changed = 0
    for name, tensor in expected.items():
        step_expected = tensor.detach() - initial[name]
        step_taken = trained[name] - initial[name]
        if step_expected.abs().max() == 0:  # not adapted: frozen, bit for bit
            assert torch.equal(trained[name], initial[name]), name
            continue
        changed += 1
        torch.testing.assert_close(step_taken, step_expected, rtol=1e-3, atol=1e-7)
    assert changed == 7 * base.config.num_hidden_layers  # every adapted linear layer moved

    # the reference stays the base model after the update; the policy does not
    after = group.compute_ref_log_prob(batch).batch[REF_LOG_PROB]
    torch.testing.assert_close(after * mask, base_log_probs * mask, atol=1e-5, rtol=0)
    policy = group.compute_log_prob(batch).batch[OLD_LOG_PROBS]
    assert ((policy - base_log_probs).abs() * mask).max() > 1e-3

    # the switch gives the generation engine the policy (base, then adapters): its log-probs are the trainer's;
    # after another update the next switch moves the adapters only, and they replace the ones before
    adapter_mb = sum(p.numel() * 4 for p in adapters) / 2**20
    whole_mb = sum(p.numel() * 4 for p in base.parameters()) / 2**20
    synced = switches_serve_the_trained_policy(group, batch, prompts_of(rollout_batch))
    assert synced == pytest.approx([whole_mb + adapter_mb, adapter_mb])
    pool.release()


def test_a_mixture_s_actor_trains_an_adapter_per_expert_and_serves_them(
    local_ray, rollout_batch, actor_config_factory, actor_worker_factory
):
    """peft's per-expert adapters (target_parameters) on tiny Qwen3-MoE's expert weights, beside q/v: one update
    over 2 FSDP2 ranks equals peft's in this process, every expert's weights move by their own B_e A_e, and the
    engine generates with the trained policy (its log-probs are the trainer's)."""
    path = str(resolve_model_path("tiny-qwen3-moe"))
    experts = "[experts.gate_up_proj,experts.down_proj]"
    config = actor_config_factory(
        path,
        LR,
        *LORA,
        "actor_rollout_ref.model.lora.target_modules=[q_proj,v_proj]",
        f"actor_rollout_ref.model.lora.target_parameters={experts}",
    )
    pool = RayResourcePool([2])
    group = RayWorkerGroup(pool, actor_worker_factory(config, 2))
    batch = rollout_batch.select(deepcopy=True)
    mask = batch.batch[RESPONSE_MASK].float()
    base = load_causal_lm(path, dtype=torch.float32).eval()

    batch.batch[OLD_LOG_PROBS] = group.compute_log_prob(batch).batch[OLD_LOG_PROBS]
    group.update_actor(batch)
    trained = group.full_state_dict()[0]
    expected, _ = peft_step(path, config, batch, mask)
    initial = dict(base.named_parameters())
    moved = set()
    for name, tensor in expected.items():
        step_expected = tensor.detach() - initial[name]
        if step_expected.abs().max() == 0:
            assert torch.equal(trained[name], initial[name]), name
            continue
        moved.add(name.rsplit(".", 1)[-1] if "experts" in name else name.split(".")[-2])
        torch.testing.assert_close(trained[name] - initial[name], step_expected, rtol=1e-3, atol=1e-6)
    assert moved == {"gate_up_proj", "down_proj", "q_proj", "v_proj"}
    every_expert = trained["model.layers.0.mlp.experts.down_proj"] - initial["model.layers.0.mlp.experts.down_proj"]
    assert (every_expert.flatten(1).abs().amax(1) > 0).all()  # each expert's own adapter trained

    switches_serve_the_trained_policy(group, batch, prompts_of(rollout_batch))  # base and adapters, then adapters
    pool.release()
