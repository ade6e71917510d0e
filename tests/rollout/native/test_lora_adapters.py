"""A LoRA policy on the native engine, both ways: adapters served (x W^T + s·(x A^T) B^T at each matmul, the
base untouched) and merged (W + s·B A written from a kept copy of the base). Either way the engine's
log-probs are peft's own forward's, and a second set of adapters replaces the first (no drift)."""

import copy

import pytest
import torch
from lora_helpers import EXPERTS, lora_model, randomise_adapters
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of

from hybridflow.engine.lora import adapter_tensors, base_parameters, lora_scaling
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.models.adapters import LORA_A, adapter_name
from hybridflow.models.tiny import is_moe
from hybridflow.rollout.adapter_merge import AdapterMerge
from hybridflow.rollout.native import NativeRollout

SOME = ["q_proj", "v_proj", "up_proj", "down_proj"]  # fused and whole matrices, some parts of a fused one only
MLP = ("up_proj", "down_proj")  # an MoE has these inside its experts (target_parameters, tested on its own)


def peft_log_probs(peft_model, batch) -> torch.Tensor:
    """The log-probs peft's model gives the engine's responses (B, R)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = peft_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = batch["responses"].shape[1]
    chosen = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1)
    return chosen.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def serves_new_adapters_as_peft(rollout, peft_model, prompts, base_batch) -> tuple[dict, torch.Tensor]:
    """Give the engine the base, then two sets of adapters (the second replaces the first): each time its log-probs
    are peft's forward's, and not the base's. The last batch and the log-probs peft gave it."""
    rollout.load_base_weights(base_parameters(peft_model))
    for seed in (1, 2):
        randomise_adapters(peft_model, seed)
        rollout.load_adapters(adapter_tensors(peft_model), lora_scaling(peft_model))
        batch = rollout.generate_sequences(prompts, greedy(10)).batch
        mask = batch["response_mask"].float()
        expected = peft_log_probs(peft_model, batch)
        torch.testing.assert_close(batch["rollout_log_probs"] * mask, expected * mask, atol=1e-4, rtol=0)
        assert ((batch["rollout_log_probs"] - base_batch["rollout_log_probs"]).abs() * mask).max() > 1e-2
    return batch, expected


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen3-moe", "tiny-olmoe"])
def tiny_moe(request):
    model = load_causal_lm(request.param, dtype=torch.float32).eval()
    return request.param, model, load_tokenizer(request.param)


@pytest.mark.parametrize("mode", ["served", "merged"])
@pytest.mark.parametrize("parameters", [EXPERTS, EXPERTS[1:]], ids=["both", "down"])
def test_adapters_on_each_expert_give_peft_s_policy(tiny_moe, mode, parameters):
    """peft's per-expert adapters (target_parameters) beside the attention's: served inside the routed matmuls,
    or merged into the (E, out, in) weights; a second set replaces the first, and an expert weight the second set
    leaves out loses its adapters."""
    _, model, tokenizer = tiny_moe
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config(adapters=mode))
    prompts = prompts_of(tokenizer, QUESTIONS)
    base_batch = rollout.generate_sequences(prompts, greedy(10)).batch
    peft_model = lora_model(copy.deepcopy(model), targets=["q_proj"], parameters=parameters).eval()
    batch, expected = serves_new_adapters_as_peft(rollout, peft_model, prompts, base_batch)
    mask = batch["response_mask"].float()
    # the experts' adapters matter: the same policy without them gives other log-probs
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if ".experts." in name and ".lora_B." in name:
                parameter.zero_()
    assert ((peft_log_probs(peft_model, batch) - expected).abs() * mask).max() > 1e-3
    served = rollout.engine.weights.layers[0].experts
    if mode == "served":
        assert (served.gate_up_adapter is not None) == (EXPERTS[0] in parameters)
        assert served.down_adapter is not None
        rollout.load_adapters(
            [(n, t) for n, t in adapter_tensors(peft_model) if ".experts." not in n], lora_scaling(peft_model)
        )
        assert served.gate_up_adapter is None and served.down_adapter is None


@pytest.mark.parametrize("mode", ["served", "merged"])
@pytest.mark.parametrize("targets", [SOME, ["all-linear"]], ids=["some", "all"])
def test_the_engine_generates_with_peft_s_policy_and_new_adapters_replace_the_old(tiny, mode, targets):
    name, model, tokenizer = tiny
    if is_moe(name):
        targets = [target for target in targets if target not in MLP]
    peft_model = lora_model(copy.deepcopy(model), targets=targets).eval()
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config(adapters=mode))
    prompts = prompts_of(tokenizer, QUESTIONS)
    base_batch = rollout.generate_sequences(prompts, greedy(10)).batch
    qkv = rollout.engine.weights.layers[0].qkv.weight
    base_qkv = qkv.clone()

    serves_new_adapters_as_peft(rollout, peft_model, prompts, base_batch)
    if mode == "served":
        assert torch.equal(qkv, base_qkv)  # the engine's own weights never change
    else:
        assert not torch.equal(qkv, base_qkv)


def test_served_adapters_on_the_output_head_leave_a_tied_embedding_as_it_is(tiny):
    """The training service's adapters may adapt the output head (train_unembed); served, they change what the
    head computes and not the input embedding, even where the two are one tensor (tiny-qwen2)."""
    _, model, tokenizer = tiny
    peft_model = lora_model(copy.deepcopy(model), targets=["all-linear", "lm_head"]).eval()
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config(adapters="served"))
    embed = rollout.engine.weights.embed.clone()
    rollout.load_base_weights(base_parameters(peft_model))
    adapters = dict(adapter_tensors(peft_model))
    assert "lm_head.lora_A" in adapters
    rollout.load_adapters(adapters.items(), lora_scaling(peft_model))
    batch = rollout.generate_sequences(prompts_of(tokenizer, QUESTIONS), greedy(10)).batch
    mask = batch["response_mask"].float()
    expected = peft_log_probs(peft_model, batch)
    torch.testing.assert_close(batch["rollout_log_probs"] * mask, expected * mask, atol=1e-4, rtol=0)
    assert torch.equal(rollout.engine.weights.embed, embed)


def test_served_adapters_refuse_a_layer_the_engine_does_not_have(tiny):
    _, model, tokenizer = tiny
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config())
    hidden = model.config.hidden_size
    embedding = "model.embed_tokens"
    with pytest.raises(KeyError, match="embed_tokens"):
        rollout.load_adapters(
            [(f"{embedding}.lora_A", torch.zeros(2, hidden)), (f"{embedding}.lora_B", torch.zeros(5, 2))], 1.0
        )
    with pytest.raises(ValueError, match="needs both"):
        rollout.load_adapters([(adapter_name("model.layers.0.self_attn.q_proj", LORA_A), torch.zeros(2, hidden))], 1.0)
    layer = "model.layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match="do not fit"):
        rollout.load_adapters(
            [(f"{layer}.lora_A", torch.zeros(2, hidden + 1)), (f"{layer}.lora_B", torch.zeros(4, 2))], 1.0
        )


def test_merging_needs_the_base_first_and_gives_every_weight_when_the_engine_reloads_whole():
    weight, other = torch.ones(3, 2), torch.full((4,), 7.0)
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [-1.0]])
    layer = "model.layers.0.mlp.up_proj"
    adapters = [(f"{layer}.lora_A", a), (f"{layer}.lora_B", b)]
    with pytest.raises(RuntimeError, match="base weights"):
        list(AdapterMerge(every_weight=False).merged(adapters, 2.0))
    merge = AdapterMerge(every_weight=True)
    base = [(f"{layer}.weight", weight), ("model.norm.weight", other)]
    assert [name for name, _ in merge.keep(base)] == [f"{layer}.weight", "model.norm.weight"]
    weight.add_(100.0)  # the caller's tensor changes later: the kept copy does not
    merged = dict(merge.merged(adapters, 2.0))
    torch.testing.assert_close(merged[f"{layer}.weight"], torch.ones(3, 2) + 2.0 * b @ a)  # by hand: W + s·B A
    assert torch.equal(merged["model.norm.weight"], other)
    with pytest.raises(ValueError, match="one adapter of the two"):
        list(merge.merged(adapters[:1], 2.0))
    # an engine that takes weights one by one gets the adapted ones only, and the copies of the rest are dropped
    alone = AdapterMerge(every_weight=False)
    list(alone.keep([(f"{layer}.weight", torch.ones(3, 2)), ("model.norm.weight", other)]))
    for scaling in (2.0, 3.0):
        merged = dict(alone.merged(adapters, scaling))
        assert merged.keys() == alone.base.keys() == {f"{layer}.weight"}
        torch.testing.assert_close(merged[f"{layer}.weight"], torch.ones(3, 2) + scaling * b @ a)
