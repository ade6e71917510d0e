"""Sparse upcycling: a dense Llama-family model turned into a Mixtral-architecture mixture of experts that computes
exactly what the dense model computes (Komatsuzaki et al. 2022, arXiv 2212.05055).

Every MLP becomes ``experts`` copies of itself and a new router picks ``top_k`` of them per token. Mixtral
renormalises the chosen routing weights to sum to 1, so with identical experts a token's output is the dense MLP's,
whichever experts the router picks: the model answers exactly as the dense one at step 0, and training makes the
experts diverge. All other weights (attention, norms, embeddings, the head, tied or not) are copied unchanged. The
router starts random (normal, the config's ``initializer_range``, seeded): a zero router would send every token to
the same experts, and under renormalisation the language-model loss alone gives the router almost no gradient until
the experts differ (the balancing loss moves it from the start).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig

DENSE_FAMILIES = ("llama", "mistral")  # attention without biases, a SwiGLU MLP: what Mixtral's layers are


def upcycled_config(dense: PretrainedConfig, experts: int, top_k: int) -> MixtralConfig:
    """The Mixtral config of ``dense`` with ``experts`` experts per layer, ``top_k`` per token."""
    if dense.model_type not in DENSE_FAMILIES:
        raise ValueError(f"upcycling reads a dense {' or '.join(DENSE_FAMILIES)} model, not {dense.model_type!r}")
    if getattr(dense, "attention_bias", False) or getattr(dense, "mlp_bias", False):
        raise ValueError("upcycling copies into Mixtral layers, which have no attention or MLP biases")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k {top_k} must be 1 to the {experts} experts")
    return MixtralConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=getattr(dense, "head_dim", None) or dense.hidden_size // dense.num_attention_heads,
        hidden_act=dense.hidden_act,
        max_position_embeddings=dense.max_position_embeddings,
        rms_norm_eps=dense.rms_norm_eps,
        rope_parameters=dense.rope_parameters,
        sliding_window=getattr(dense, "sliding_window", None) if dense.model_type == "mistral" else None,
        tie_word_embeddings=dense.tie_word_embeddings,
        initializer_range=dense.initializer_range,
        pad_token_id=dense.pad_token_id,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )


def upcycled_state(dense: dict[str, torch.Tensor], config: MixtralConfig, seed: int) -> dict[str, torch.Tensor]:
    """The Mixtral weights: ``dense``'s, each MLP copied into every expert, and a seeded random router per layer."""
    generator = torch.Generator().manual_seed(seed)
    state, experts = {}, config.num_local_experts
    for name, tensor in dense.items():
        if ".mlp." not in name:
            state[name] = tensor
    for layer in range(config.num_hidden_layers):
        mlp = f"model.layers.{layer}.mlp"
        gate, up, down = (dense[f"{mlp}.{part}_proj.weight"] for part in ("gate", "up", "down"))
        state[f"{mlp}.experts.gate_up_proj"] = torch.cat([gate, up]).expand(experts, -1, -1).clone()
        state[f"{mlp}.experts.down_proj"] = down.expand(experts, -1, -1).clone()
        router = torch.randn(experts, config.hidden_size, generator=generator) * config.initializer_range
        state[f"{mlp}.gate.weight"] = router.to(gate.dtype)
    return state


def upcycle(dense_dir: str | Path, out: str | Path, *, experts: int, top_k: int, seed: int = 0) -> Path:
    """Write the upcycled model of the Hugging Face directory ``dense_dir`` (and its tokenizer files) to ``out``."""
    from hybridflow.models import load_tokenizer

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    config = upcycled_config(dense.config, experts, top_k)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(upcycled_state(dense.state_dict(), config, seed), strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = dense.generation_config
    out = Path(out)
    model.save_pretrained(out)
    load_tokenizer(str(dense_dir)).save_pretrained(out)
    return out
