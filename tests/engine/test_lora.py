"""LoRA through peft: the settings' checks, the frozen base, adapters off = the base model, and the merged
weights against peft's own forward (fp32, tight tolerance)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lora_helpers import randomise_adapters

from hybridflow.engine.config import FSDPConfig
from hybridflow.engine.fsdp import data_parallel_mesh, shard_model
from hybridflow.engine.lora import (
    ALL_LINEAR,
    LoraConfig,
    adapters_off,
    apply_lora,
    is_lora,
    linear_layer_names,
    merged_parameters,
    target_problem,
)
from hybridflow.models import load_causal_lm
from hybridflow.validation import InvalidSetting

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(**changes) -> LoraConfig:
    return LoraConfig(
        **{"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": TARGETS, "target_parameters": [], **changes}
    )


def randomised_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    randomise_adapters(model, seed, scale=0.05)


def inputs(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("field,value", [("rank", -1), ("alpha", 0.0), ("dropout", 1.0), ("target_modules", [])])
def test_settings_are_checked(field, value):
    with pytest.raises(InvalidSetting) as error:
        lora(**{field: value})
    assert error.value.field == field
    assert not LoraConfig(
        rank=0, alpha=8.0, dropout=0.0, target_modules=[], target_parameters=[]
    ).enabled  # off needs no targets


def test_target_modules_are_checked_against_the_model(tiny_path):
    model = load_causal_lm(tiny_path, dtype=torch.float32)
    names = linear_layer_names(model)
    assert names == set(TARGETS)  # the output head is not a target
    assert target_problem(["q_proj", "v_proj"], names) is None
    assert target_problem([ALL_LINEAR], names) is None
    problem = target_problem(["q_proj", "qkv_proj"], names)
    assert "['qkv_proj']" in problem and "q_proj" in problem


def test_only_the_adapters_train_and_the_base_is_frozen_in_its_dtype(tiny_path):
    model = apply_lora(load_causal_lm(tiny_path, dtype=torch.float32), lora(), frozen_dtype=torch.bfloat16)
    assert is_lora(model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    assert all(p.dtype == torch.bfloat16 for p in frozen.values())
    layers = model.config.num_hidden_layers
    assert len(trainable) == 2 * len(TARGETS) * layers  # A and B of each adapted layer


def test_adapters_off_is_the_base_model_exactly(tiny_path):
    base = load_causal_lm(tiny_path, dtype=torch.float32).eval()
    ids = inputs(base.config.vocab_size)
    with torch.no_grad():
        expected = base(input_ids=ids).logits
    model = apply_lora(load_causal_lm(tiny_path, dtype=torch.float32), lora()).eval()
    randomised_adapters(model)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with adapters_off(model):
            off = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert torch.equal(off, expected)
    assert (adapted - expected).abs().max() > 1e-2  # the adapters change the output
    assert torch.equal(again, adapted)  # and come back on after the block


def _reference_first_then_train(rank: int, tiny_path: str, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        model = apply_lora(load_causal_lm(tiny_path, dtype=torch.float32), lora(), frozen_dtype=torch.bfloat16)
        model = shard_model(
            model,
            data_parallel_mesh(torch.device("cpu")),
            FSDPConfig(param_dtype="bf16", reduce_dtype="fp32", host_collectives=True),
        )
        ids = inputs(model.config.vocab_size)
        with torch.no_grad(), adapters_off(model):  # FSDP2's first forward: the reference, adapters off
            model(input_ids=ids)
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        results.put(sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}))
    finally:
        dist.destroy_process_group()


def test_adapters_train_after_a_first_forward_with_them_off(tiny_path, tmp_path):
    """The reference pass may be a sharded LoRA actor's first forward (FSDP2 fixes its gradient dtypes then):
    the adapters must still get their fp32 gradients, which peft's own disable_adapter() prevented."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_reference_first_then_train, args=(tiny_path, str(tmp_path / "init"), results), nprocs=1)
    assert results.get() == ["torch.float32"]


def test_merged_weights_give_peft_s_forward(tiny_path):
    """A plain model loaded with the merged weights computes what peft's adapted model does."""
    model = apply_lora(load_causal_lm(tiny_path, dtype=torch.float32), lora(alpha=16.0)).eval()
    randomised_adapters(model, seed=3)
    ids = inputs(model.config.vocab_size, seed=4)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    plain = load_causal_lm(tiny_path, dtype=torch.float32).eval()
    merged = dict(merged_parameters(model.named_parameters(), scaling=16.0 / 4))
    assert set(merged) == set(dict(plain.named_parameters()))
    plain.load_state_dict(merged, strict=False)
    with torch.no_grad():
        logits = plain(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # and peft's own merge agrees with ours, weight by weight
    reference = dict(model.merge_and_unload().named_parameters())
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6)


def test_merging_needs_every_part_of_an_adapted_layer():
    weight = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="self_attn.q_proj"):
        list(merged_parameters([("base_model.model.layers.0.self_attn.q_proj.base_layer.weight", weight)], 1.0))


def test_a_critic_trains_its_value_head_whole_and_adapters_elsewhere(tiny_path):
    from hybridflow.engine.lora import heads
    from hybridflow.models.loading import load_critic

    critic = load_critic(tiny_path, dtype=torch.float32)
    assert heads(critic) == ["score"]
    assert heads(load_causal_lm(tiny_path, dtype=torch.float32)) == []  # the LM head is not trained whole
    model = apply_lora(critic, lora(target_modules=[ALL_LINEAR]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    value_head = [n for n in trainable if ".score." in n]
    assert value_head and all("modules_to_save" in n for n in value_head)  # a trained copy of the head
    assert all(".lora_" in n for n in trainable if n not in value_head)
    assert not any(".score.lora_" in n for n in trainable)  # the head is not LoRA-adapted
    ids = inputs(critic.config.vocab_size)
    assert model(input_ids=ids).logits.shape == (2, 12, 1)


def test_a_checkpoint_of_a_model_with_tied_embeddings_holds_the_adapters_only(tmp_path):
    """tiny-qwen2 ties its LM head to the embedding: a second name of a frozen weight, which torch's
    ignore_frozen_params alone would save (the embedding's size, in every checkpoint); a load puts the adapters
    and their optimizer state back."""
    from torch.distributed.checkpoint import FileSystemReader

    from hybridflow.engine.checkpoint import SHARDS, load_training_state, save_training_state
    from hybridflow.engine.optim import TrainedModel
    from hybridflow.trainer.setup.config import default_config

    def trained() -> TrainedModel:
        torch.manual_seed(0)
        model = apply_lora(load_causal_lm("tiny-qwen2", dtype=torch.float32), lora())
        return TrainedModel.build(model, default_config().actor_rollout_ref.actor.optim, total_steps=4)

    first = trained()
    assert first.model.config.tie_word_embeddings
    randomised_adapters(first.model)
    loss = first.model(input_ids=inputs(first.model.config.vocab_size)).logits.square().mean()
    loss.backward()
    first.optimizer.step()
    save_training_state(tmp_path, first, rank=0)
    saved = FileSystemReader(str(tmp_path / SHARDS)).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert weights == {n for n, p in first.model.named_parameters() if p.requires_grad}

    second = trained()
    load_training_state(tmp_path, second, rank=0)
    for (name, want), have in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(have, want), name
    for want, have in zip(first.optimizer.state.values(), second.optimizer.state.values()):
        assert torch.equal(have["exp_avg"], want["exp_avg"])


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-olmoe", "tiny-mixtral"])
def test_adapters_on_each_expert_merge_as_peft_merges_them(name):
    """peft's target_parameters give each expert e of an (E, out, in) weight its own B_e A_e: our merge equals
    peft's merge_and_unload weight by weight, gives its forward, and the rollout side's merge of the travelling
    adapters (rollout/adapter_merge.py) gives the same weights."""
    from hybridflow.engine.lora import adapted_weights, adapter_tensors, base_parameters, expert_weight_names
    from hybridflow.rollout.adapter_merge import AdapterMerge

    experts = ["experts.gate_up_proj", "experts.down_proj"]
    settings = lora(alpha=16.0, target_modules=["q_proj"], target_parameters=experts)
    model = apply_lora(load_causal_lm(name, dtype=torch.float32), settings).eval()
    assert expert_weight_names(model) >= set(experts)
    randomised_adapters(model, seed=5)
    ids = inputs(model.config.vocab_size, seed=6)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    merged = dict(merged_parameters(model.named_parameters(), 4.0, adapted_weights(model)))
    plain = load_causal_lm(name, dtype=torch.float32).eval()
    assert set(merged) == set(dict(plain.named_parameters()))
    plain.load_state_dict(merged, strict=False)  # a tied head is the embedding
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    rollout_side = AdapterMerge(every_weight=True)
    list(rollout_side.keep(base_parameters(model)))
    travelled = dict(rollout_side.merged(adapter_tensors(model), 4.0))
    reference = dict(model.merge_and_unload().named_parameters())
    for weight, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[weight], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(travelled[weight], reference[weight], rtol=1e-6, atol=1e-6)
    base = dict(load_causal_lm(name, dtype=torch.float32).named_parameters())
    moved = reference["model.layers.1.mlp.experts.gate_up_proj"] - base["model.layers.1.mlp.experts.gate_up_proj"]
    assert (moved.flatten(1).abs().amax(1) > 1e-3).all()  # every expert has an adapter of its own
