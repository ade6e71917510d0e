"""The tensor-parallel table of each model family, and the rule that a size must split heads and MLP evenly."""

import pytest

from hybridflow.models.split_sizes import check_split_sizes, indivisible_sizes
from hybridflow.models.tensor_parallel import LAYER_SPLITS, LLAMA, MIXTURE, layer_split


def test_the_split_of_each_tensor():
    assert LLAMA.shard_dim("model.layers.3.self_attn.q_proj.weight") == 0
    assert LLAMA.shard_dim("model.layers.3.self_attn.k_proj.bias") == 0
    assert LLAMA.shard_dim("model.layers.3.self_attn.v_proj.weight") == 0
    assert LLAMA.shard_dim("model.layers.3.mlp.gate_proj.weight") == 0
    assert LLAMA.shard_dim("model.layers.3.mlp.up_proj.weight") == 0
    assert LLAMA.shard_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert LLAMA.shard_dim("model.layers.3.mlp.down_proj.weight") == 1
    assert LLAMA.shard_dim("model.layers.3.self_attn.o_proj.bias") is None  # whole, added once
    assert LLAMA.shard_dim("model.layers.3.input_layernorm.weight") is None
    assert LLAMA.shard_dim("model.embed_tokens.weight") is None
    assert LLAMA.shard_dim("lm_head.weight") is None


def test_row_parallel_biases():
    assert LLAMA.is_row_bias("model.layers.0.self_attn.o_proj.bias")
    assert LLAMA.is_row_bias("self_attn.o_proj.bias")
    assert not LLAMA.is_row_bias("model.layers.0.self_attn.o_proj.weight")
    assert not LLAMA.is_row_bias("model.layers.0.self_attn.q_proj.bias")


def test_each_family_has_llamas_layer_or_a_mixture_s_and_others_are_refused():
    assert list(LAYER_SPLITS) == ["llama", "qwen2", "mistral", "mixtral", "qwen3_moe", "olmoe"]
    assert all(layer_split(name) is LLAMA for name in ("llama", "qwen2", "mistral"))
    assert layer_split("mixtral") is MIXTURE
    for family in ("qwen3_moe", "olmoe"):  # a mixture's, with q/k norms (per head, or over every head)
        split = layer_split(family)
        assert (split.column, split.row, split.experts) == (MIXTURE.column, MIXTURE.row, MIXTURE.experts)
    assert (
        layer_split("qwen3_moe").head_norms
        == layer_split("olmoe").all_head_norms
        == (
            "self_attn.q_norm",
            "self_attn.k_norm",
        )
    )
    with pytest.raises(ValueError, match="no tensor-parallel plan for model type 'gpt2'; plans: llama, qwen2, mistral"):
        layer_split("gpt2")


def test_a_mixture_splits_its_experts_whole_and_keeps_their_adapters_whole():
    """Generation groups split a mixture by expert (dimension 0 of an (E, out, in) weight); the router stays whole,
    and so do the experts' LoRA adapters (peft interleaves the experts in B's columns: the engine slices them)."""
    for weight in ("gate_up_proj", "down_proj"):
        assert MIXTURE.shard_dim(f"model.layers.1.mlp.experts.{weight}") == 0
        assert MIXTURE.shard_dim(f"model.layers.1.mlp.experts.{weight}.lora_A") is None
        assert MIXTURE.shard_dim(f"model.layers.1.mlp.experts.{weight}.lora_B") is None
    assert MIXTURE.shard_dim("model.layers.1.mlp.gate.weight") is None
    assert MIXTURE.shard_dim("model.layers.1.self_attn.q_proj.weight") == 0
    assert MIXTURE.shard_dim("model.layers.1.self_attn.o_proj.weight") == 1
    # Qwen3-MoE's q/k norms are per head (every rank holds the same); OLMoE's span every head (each rank its heads')
    assert layer_split("qwen3_moe").shard_dim("model.layers.1.self_attn.q_norm.weight") is None
    assert layer_split("olmoe").shard_dim("model.layers.1.self_attn.k_norm.weight") == 0


def test_a_size_must_split_heads_and_mlp_evenly():
    sizes = dict(heads=8, kv_heads=2, intermediate_size=12)
    assert indivisible_sizes(2, **sizes) == {}
    assert indivisible_sizes(4, **sizes) == {"num_key_value_heads": 2}
    assert indivisible_sizes(8, **sizes) == {"num_key_value_heads": 2, "intermediate_size": 12}
    check_split_sizes(2, "t", **sizes)
    message = (
        "t=4 does not divide the model's {'num_key_value_heads': 2}: choose a common divisor of "
        "num_attention_heads=8, num_key_value_heads=2, intermediate_size=12"
    )
    with pytest.raises(ValueError) as error:
        check_split_sizes(4, "t", **sizes)
    assert str(error.value) == message


def test_a_mixture_s_experts_are_what_generation_ranks_divide():
    sizes = dict(heads=8, kv_heads=2, intermediate_size=12, experts=6)
    assert indivisible_sizes(2, **sizes) == {}
    assert indivisible_sizes(4, **sizes) == {"num_key_value_heads": 2, "num_experts": 6}  # not the experts' width
