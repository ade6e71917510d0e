"""Greedy generation and log-probs of the native engine against transformers (fp32, tiny models)."""

import pytest
import torch
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of, response_logits, sampled, token_log_probs

from hybridflow.rollout.hf import HFRollout
from hybridflow.rollout.native import NativeRollout


@pytest.mark.parametrize("min_shared_prefix", [1, 10**9], ids=["shared-prefix", "no-shared-prefix"])
def test_greedy_equals_transformers_token_for_token(tiny, min_shared_prefix):
    _, model, tokenizer = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)  # different lengths, left-padded
    native = NativeRollout(model, tokenizer, engine_config=engine_config())
    native.engine.min_shared_prefix = min_shared_prefix
    expected = HFRollout(model, tokenizer).generate_sequences(prompts, greedy(10)).batch
    got = native.generate_sequences(prompts, greedy(10)).batch
    assert set(got.keys()) == set(expected.keys())
    for key in expected.keys():
        if key != "rollout_log_probs":
            assert torch.equal(got[key], expected[key]), key
    assert torch.allclose(got["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-5)
    assert (native.stats.shared_prefix_tokens > 0) == (min_shared_prefix == 1)


@pytest.mark.parametrize("ragged", [True, False], ids=["real-lengths", "whole-rows"])
def test_log_probs_match_an_independent_forward_pass(tiny, ragged):
    """Decode attends over each sequence's real length (the C++ kernel) or its slot's whole row: both give the
    forward's log-probs."""
    _, model, tokenizer = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)
    native = NativeRollout(model, tokenizer, engine_config=engine_config(ragged_decode=ragged))
    assert native.engine.ragged == ragged
    out = native.generate_sequences(prompts, greedy(10)).batch
    logits = response_logits(model, out, prompts.batch["input_ids"].shape[1])
    expected = token_log_probs(logits, out["responses"])
    mask = out["response_mask"].bool()
    assert torch.allclose(out["rollout_log_probs"][mask], expected[mask], atol=1e-5)
    assert torch.equal(out["responses"][mask], logits.argmax(-1)[mask])


def test_temperature_scales_the_returned_log_probs(tiny):
    _, model, tokenizer = tiny
    prompts = prompts_of(tokenizer, QUESTIONS[:2])
    params = sampled(seed=5, max_new_tokens=6, temperature=0.7)
    out = NativeRollout(model, tokenizer, engine_config=engine_config()).generate_sequences(prompts, params).batch
    logits = response_logits(model, out, prompts.batch["input_ids"].shape[1])
    expected = token_log_probs(logits / 0.7, out["responses"])
    mask = out["response_mask"].bool()
    assert torch.allclose(out["rollout_log_probs"][mask], expected[mask], atol=1e-5)


LAYOUTS = ["mistral", "llama-with-attention-bias", "qwen3-moe-with-norm-weights-and-biases", "olmoe-with-clip-qkv"]


@pytest.mark.parametrize("family", LAYOUTS)
def test_other_layouts_match_transformers(family):
    """Mistral, Llama with biases on q/k/v/o, Qwen3-MoE with q/k norm weights other than 1, biases and routing weights
    not renormalised, and OLMoE with such norm weights, renormalised routing and q/k/v clamped: built from a config
    (random weights, seeded)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from hybridflow.models import load_tokenizer

    tokenizer = load_tokenizer("tiny-llama")
    sizes = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    experts = dict(num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(**sizes, sliding_window=None, rope_theta=50_000.0))
    elif family.startswith("qwen3"):
        config = Qwen3MoeConfig(
            **sizes, **experts, moe_intermediate_size=32, norm_topk_prob=False, attention_bias=True, head_dim=16
        )
        model = Qwen3MoeForCausalLM(config)
    elif family.startswith("olmoe"):
        model = OlmoeForCausalLM(OlmoeConfig(**sizes, **experts, norm_topk_prob=True, clip_qkv=0.5))
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes, attention_bias=True, tie_word_embeddings=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)  # transformers initialises biases at zero
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(mean=1.0, std=0.5)  # and norm weights at one
    model.eval()
    prompts = prompts_of(tokenizer, QUESTIONS)
    expected = HFRollout(model, tokenizer).generate_sequences(prompts, greedy(10)).batch
    got = NativeRollout(model, tokenizer, engine_config=engine_config()).generate_sequences(prompts, greedy(10)).batch
    assert torch.equal(got["responses"], expected["responses"])
    assert torch.allclose(got["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-5)


def test_a_qwen3_moe_with_dense_layers_is_refused():
    """transformers gives Qwen3-MoE's mlp_only_layers (and layers off decoder_sparse_step) a dense MLP of
    intermediate_size; the engine runs experts in every layer and says so."""
    from transformers import Qwen3MoeConfig

    from hybridflow.rollout.native.spec import spec_from_config

    base = dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, intermediate_size=96)
    spec = spec_from_config(Qwen3MoeConfig(**base, moe_intermediate_size=24))
    assert (spec.num_experts, spec.intermediate_size, spec.qk_norm) == (4, 24, "head")  # the experts' width
    for dense, refused in [(dict(mlp_only_layers=[2]), r"\[2\]"), (dict(decoder_sparse_step=2), r"\[0, 2\]")]:
        with pytest.raises(NotImplementedError, match=rf"dense MLPs in layers {refused}"):
            spec_from_config(Qwen3MoeConfig(**base, **dense))
