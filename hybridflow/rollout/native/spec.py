"""The shape of a Llama-family decoder, read from a Hugging Face config: Llama, Qwen2, Mistral, and the mixtures of
experts Mixtral (Mistral's layers with experts for the MLP), Qwen3-MoE and OLMoE (the same with RMSNorms on q and k)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "mixtral", "qwen3_moe", "olmoe")
_MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the native forward needs to know about the architecture."""

    num_layers: int
    hidden_size: int
    num_heads: int
    """Query heads (Hq)."""
    num_kv_heads: int
    """Key/value heads (Hkv); Hq / Hkv query heads share one kv head (GQA)."""
    head_dim: int
    intermediate_size: int
    """Width of each MLP the engine computes: the dense one, or each expert (Qwen3-MoE's ``moe_intermediate_size``)."""
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None = None
    """Mistral's attention window; sequences longer than it are refused (the engine attends to all keys)."""
    num_experts: int = 0
    """Experts of each layer's MLP (0: a dense MLP); each of width ``intermediate_size``."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k of a softmax over the router's logits)."""
    normalize_top_k: bool = True
    """The chosen experts' weights renormalised to sum to 1 (Mixtral always, Qwen3-MoE and OLMoE by
    ``norm_topk_prob``)."""
    round_routing_weights: bool = False
    """The chosen weights rounded to the hidden dtype before they scale the experts' outputs (Qwen3-MoE and OLMoE;
    Mixtral scales in fp32)."""
    qk_norm: str | None = None
    """RMSNorm on the projected queries and keys, before rotary: "head" over each head's D values (Qwen3-MoE, one
    (D,) weight each for q and k), "full" over all of q's and all of k's values (OLMoE, weights (Q,) and (K,))."""
    clip_qkv: float | None = None
    """OLMoE's clamp of q, k and v (after the norms) to [-clip_qkv, clip_qkv]; None: unclamped."""

    @property
    def group_size(self) -> int:
        """Query heads per kv head (G = Hq / Hkv)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def flops_per_token(self, context: int = 0) -> float:
        """Forward FLOPs of one token: 2 per weight of the matmuls, plus attention over `context` keys."""
        h, i = self.hidden_size, self.intermediate_size
        active = self.experts_per_token if self.num_experts else 1  # the experts a token runs through
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i * active + h * self.num_experts
        attention = 2 * self.num_heads * self.head_dim * context  # q.k and p.v per layer
        return self.num_layers * (2 * per_layer + 2 * attention) + 2 * h * self.vocab_size


def spec_from_config(config: PretrainedConfig) -> ModelSpec:
    """The spec of a config of one of SUPPORTED_MODEL_TYPES; raises on features the engine does not implement."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"native rollout supports {SUPPORTED_MODEL_TYPES}, not {config.model_type!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"native rollout implements SwiGLU (silu), not {config.hidden_act!r}")
    if getattr(config, "mlp_bias", False):
        raise NotImplementedError("native rollout does not implement MLP biases")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"native rollout implements the default rotary embedding, not {rope_type!r}")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    uses_window = getattr(config, "use_sliding_window", config.model_type in ("mistral", "mixtral"))
    window = getattr(config, "sliding_window", None) if uses_window else None
    num_heads = config.num_attention_heads
    family = config.model_type
    moe = family in _MOE_MODEL_TYPES
    dense = _dense_layers(config) if family == "qwen3_moe" else []
    if dense:
        raise NotImplementedError(
            f"native rollout runs Qwen3-MoE with experts in every layer, not dense MLPs in layers {dense} "
            "(num_experts, mlp_only_layers, decoder_sparse_step)"
        )
    return ModelSpec(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        intermediate_size=config.moe_intermediate_size if family == "qwen3_moe" else config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(theta),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        sliding_window=window,
        num_experts=(config.num_local_experts if family == "mixtral" else config.num_experts) if moe else 0,
        experts_per_token=config.num_experts_per_tok if moe else 0,
        normalize_top_k=family == "mixtral" or bool(getattr(config, "norm_topk_prob", False)),
        round_routing_weights=family in ("qwen3_moe", "olmoe"),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(family),
        clip_qkv=getattr(config, "clip_qkv", None) if family == "olmoe" else None,
    )


def _dense_layers(config: PretrainedConfig) -> list[int]:
    """The layers of a Qwen3-MoE config that keep a dense MLP instead of experts (as transformers builds them)."""
    if not config.num_experts:
        return list(range(config.num_hidden_layers))
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1)
    return [i for i in range(config.num_hidden_layers) if i in only or (i + 1) % step]
