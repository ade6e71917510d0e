"""Weight updates by Hugging Face parameter name land in the engine, in place."""

import pytest
import torch
from rollout_helpers import QUESTIONS, engine_config, greedy, perturbed, prompts_of

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.hf import HFRollout
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.linear import ExpertMatrices, cpu_packs_bf16
from hybridflow.rollout.native.model import routed_mlp


def test_after_load_weights_the_engine_generates_like_the_updated_model(tiny):
    _, model, tokenizer = tiny
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config())
    prompts = prompts_of(tokenizer, QUESTIONS)
    before = rollout.generate_sequences(prompts, greedy(10)).batch
    pointers = [t.data_ptr() for t in (rollout.engine.weights.embed, rollout.engine.weights.layers[0].qkv.weight)]
    changed = perturbed(model)
    rollout.load_weights([*changed.named_parameters(), *changed.named_buffers()])  # as full_parameters yields them
    assert pointers == [
        t.data_ptr() for t in (rollout.engine.weights.embed, rollout.engine.weights.layers[0].qkv.weight)
    ]
    expected = HFRollout(changed, tokenizer).generate_sequences(prompts, greedy(10)).batch
    got = rollout.generate_sequences(prompts, greedy(10)).batch
    assert not torch.allclose(got["rollout_log_probs"], before["rollout_log_probs"], atol=1e-2)
    assert torch.equal(got["responses"], expected["responses"])
    assert torch.allclose(got["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-5)


def test_load_weights_casts_to_the_engine_dtype_and_rejects_unknown_names(tiny):
    _, model, tokenizer = tiny
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config(), dtype=torch.bfloat16)
    norm = torch.full_like(model.model.norm.weight, 0.5)
    rollout.load_weights([("model.norm.weight", norm)])
    assert rollout.engine.weights.norm.dtype == torch.bfloat16 and (rollout.engine.weights.norm == 0.5).all()
    with pytest.raises(KeyError):
        rollout.load_weights([("model.layers.0.mlp.extra.weight", norm)])
    with pytest.raises(ValueError):
        rollout.load_weights([("model.norm.weight", norm[:-1])])
    with pytest.raises(IndexError, match="the model has 2 decoder layers"):  # not another stage's: no such layer
        rollout.load_weights([("model.layers.7.input_layernorm.weight", norm)])


def test_bf16_engine_after_load_weights_equals_one_built_from_the_updated_model():
    model = load_causal_lm("tiny-llama", dtype=torch.bfloat16)
    tokenizer = load_tokenizer("tiny-llama")
    rollout = NativeRollout(
        model, tokenizer, engine_config=engine_config()
    )  # bf16 on CPU: the products use packed weights
    changed = perturbed(model)
    rollout.load_weights(changed.named_parameters())
    prompts = prompts_of(tokenizer, QUESTIONS)
    got = rollout.generate_sequences(prompts, greedy(10)).batch
    expected = (
        NativeRollout(changed, tokenizer, engine_config=engine_config()).generate_sequences(prompts, greedy(10)).batch
    )
    assert torch.equal(got["responses"], expected["responses"])
    assert torch.equal(got["rollout_log_probs"], expected["rollout_log_probs"])


@pytest.mark.skipif(not cpu_packs_bf16(), reason="this CPU's oneDNN packs no bf16 weights: experts use F.linear")
def test_bf16_experts_run_through_packed_weights_that_follow_every_load():
    """A bf16 mixture's experts multiply through oneDNN's packed copies of their weights (linear.py ``Matrix``): the
    routed MLP gives, bit for bit, what plain ``F.linear`` on the weights gives, before and after a load of new
    weights (a stale packed copy would give the old weights' products)."""
    model = load_causal_lm("tiny-qwen3-moe", dtype=torch.bfloat16).eval()
    engine = NativeRollout(model, load_tokenizer("tiny-qwen3-moe"), engine_config=engine_config()).engine
    experts = engine.weights.layers[0].experts
    x = torch.randn(16, experts.router.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def with_plain_products() -> torch.Tensor:
        packed = experts.matrices
        experts.matrices = ExpertMatrices(experts.gate_up, experts.down)  # never repacked: F.linear
        try:
            return routed_mlp(experts, x)
        finally:
            experts.matrices = packed

    assert all(matrix.packed is not None for matrix in experts.matrices.gate_up)
    assert torch.equal(routed_mlp(experts, x), with_plain_products())
    before = routed_mlp(experts, x)
    engine.weights.load((name, tensor) for name, tensor in perturbed(model).named_parameters() if ".experts." in name)
    after = routed_mlp(experts, x)
    assert not torch.equal(after, before)
    assert torch.equal(after, with_plain_products())
