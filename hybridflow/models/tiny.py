"""Built-in tiny models for tests: `tiny-llama` and `tiny-qwen2`, and the mixtures of experts `tiny-qwen3-moe` and
`tiny-olmoe`.

Random-initialised (seeded) Llama / Qwen2 models with the tiny byte-level tokenizer of
`tiny_tokenizer.py`, written to the cache as ordinary Hugging Face directories so that the
rest of hybridflow only ever sees a directory path. `tiny-llama` keeps a separate `lm_head`
and `tiny-qwen2` ties it to the input embedding (as Llama and small Qwen2 models do), so
tests cover both layouts; Qwen2 also has biases on q/k/v. The two MoE families replace every MLP with
`num_experts` experts of width `moe_intermediate_size`, `num_experts_per_tok` of them chosen per token: Qwen3-MoE
renormalising the chosen weights (as its released checkpoints do) and tying the head, OLMoE not, with its own head;
`tiny-mixtral` is Llama's attention with a mixture of experts (Mixtral always renormalises), its own head.

Default size (about 140k / 108k parameters) is set by `TinyModelSpec`; any field can be
overridden, e.g. `resolve_model_path("tiny-llama", hidden_size=128, num_hidden_layers=4)`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3MoeConfig,
)

from hybridflow.models import tiny_tokenizer
from hybridflow.models.cache import materialise, model_cache_dir

# Bump when the way a tiny model is built changes, so that old cache entries are not reused.
BUILD_VERSION = 1

TINY_FAMILIES = {
    "tiny-llama": "llama",
    "tiny-qwen2": "qwen2",
    "tiny-qwen3-moe": "qwen3_moe",
    "tiny-olmoe": "olmoe",
    "tiny-mixtral": "mixtral",
}
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")  # the spec's fields only MoE models read


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """The size of a tiny model; field names are those of the Hugging Face config."""

    hidden_size: int = 64
    """Width of the residual stream."""
    num_hidden_layers: int = 2
    """Number of transformer blocks."""
    num_attention_heads: int = 4
    """Query heads; must divide `hidden_size`."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide `num_attention_heads`."""
    intermediate_size: int = 128
    """Width of the SwiGLU MLP."""
    vocab_size: int = 512
    """Tokenizer and embedding size (reserved tokens fill what the corpus cannot)."""
    max_position_embeddings: int = 2048
    """Longest sequence (also the tokenizer's `model_max_length`)."""
    seed: int = 0
    """Seed of the random initialisation."""
    num_experts: int = 4
    """Experts in each MoE layer (MoE families only)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (MoE families only)."""
    moe_intermediate_size: int = 32
    """Width of each expert's SwiGLU MLP (MoE families only)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be 1 to num_experts={self.num_experts}"
            )
        if self.vocab_size < tiny_tokenizer.MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be at least {tiny_tokenizer.MIN_VOCAB_SIZE}, got {self.vocab_size}")

    def config_fields(self, moe: bool = False) -> dict[str, int]:
        """The fields that are Hugging Face config keys, by name: all but ``seed``, and the MoE ones for ``moe``."""
        skip = {"seed"} if moe else {"seed", *MOE_FIELDS}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}

    def recipe(self, name: str) -> dict[str, int]:
        """The fields model ``name`` is built from (a dense model's leave the MoE ones out: their cache keys stay)."""
        fields = dataclasses.asdict(self)
        return fields if is_moe(name) else {k: v for k, v in fields.items() if k not in MOE_FIELDS}

    @classmethod
    def with_overrides(cls, **overrides: int) -> TinyModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown tiny-model size override(s) {unknown}; known: {sorted(known)}")
        return cls(**overrides)


def tiny_cache_key(name: str, spec: TinyModelSpec) -> str:
    """A directory name that shows the size and changes with anything the build depends on.

    The short digest covers the whole spec, the builder version, the tokenizer corpus and
    the chat template, so editing any of them never reuses a stale cached model.
    """
    recipe = json.dumps(
        {
            "name": name,
            "spec": spec.recipe(name),
            "build_version": BUILD_VERSION,
            "corpus": tiny_tokenizer.tiny_corpus(),
            "chat_template": tiny_tokenizer.CHAT_TEMPLATE,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:8]
    s = spec
    experts = f"-e{s.num_experts}k{s.num_experts_per_tok}m{s.moe_intermediate_size}" if is_moe(name) else ""
    return (
        f"{name}-h{s.hidden_size}-l{s.num_hidden_layers}-a{s.num_attention_heads}-kv{s.num_key_value_heads}"
        f"-i{s.intermediate_size}{experts}-v{s.vocab_size}-s{s.seed}-{digest}"
    )


def is_moe(name: str) -> bool:
    """Whether tiny model ``name`` is a mixture of experts."""
    return TINY_FAMILIES[name] in ("qwen3_moe", "olmoe", "mixtral")


def tiny_config(name: str, spec: TinyModelSpec, pad_token_id: int, eos_token_id: int) -> PretrainedConfig:
    """The Hugging Face config of a tiny model."""
    family = TINY_FAMILIES[name]
    fields = spec.config_fields(moe=is_moe(name))
    common = dict(fields, pad_token_id=pad_token_id, bos_token_id=None, eos_token_id=eos_token_id)
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if family == "qwen3_moe":
        head_dim = spec.hidden_size // spec.num_attention_heads
        return Qwen3MoeConfig(**common, head_dim=head_dim, norm_topk_prob=True, tie_word_embeddings=True)
    if family == "olmoe":
        return OlmoeConfig(**common, norm_topk_prob=False, tie_word_embeddings=False)
    if family == "mixtral":  # experts of width moe_intermediate_size (Mixtral names it intermediate_size)
        mixtral = {
            k: v for k, v in common.items() if k not in ("intermediate_size", "num_experts", "moe_intermediate_size")
        }
        return MixtralConfig(
            **mixtral,
            intermediate_size=spec.moe_intermediate_size,
            num_local_experts=spec.num_experts,
            sliding_window=None,
            tie_word_embeddings=False,
        )
    return Qwen2Config(**common, tie_word_embeddings=True)


def tiny_model_config(name: str, **overrides: int) -> PretrainedConfig:
    """The config of tiny model `name` at the requested size, without building it (the tokenizer's special
    tokens come first, in the order of `tiny_tokenizer.SPECIAL_TOKENS`)."""
    special = tiny_tokenizer.SPECIAL_TOKENS
    pad, eos = special.index(tiny_tokenizer.PAD_TOKEN), special.index(tiny_tokenizer.EOS_TOKEN)
    return tiny_config(name, TinyModelSpec.with_overrides(**overrides), pad_token_id=pad, eos_token_id=eos)


def build_tiny_model_dir(name: str, spec: TinyModelSpec, out_dir: Path) -> None:
    """Write tokenizer, config, generation config and seeded random weights to `out_dir`."""
    tokenizer = tiny_tokenizer.build_tiny_tokenizer(spec.vocab_size, spec.max_position_embeddings)
    config = tiny_config(name, spec, tokenizer.pad_token_id, tokenizer.eos_token_id)
    # Seed a private copy of the global RNG: transformers initialises weights from it, and the
    # caller's random stream should not depend on whether the model was cached.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def materialise_tiny(name: str, **overrides: int) -> Path:
    """The cached directory of tiny model `name` at the requested size, built on first use."""
    spec = TinyModelSpec.with_overrides(**overrides)
    key = tiny_cache_key(name, spec)
    fingerprint = {"builtin": name, "spec": spec.recipe(name), "build_version": BUILD_VERSION}
    return materialise(model_cache_dir(key), fingerprint, functools.partial(build_tiny_model_dir, name, spec))
