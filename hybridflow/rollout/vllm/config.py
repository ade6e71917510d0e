"""The vLLM backend's settings (`actor_rollout_ref.rollout.vllm.*`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.validation import require, require_positive


@dataclass(kw_only=True)
class VllmEngineConfig:
    kv_cache_gb: float  # KV-cache memory per rank in GiB (CPU memory on CPU, GPU memory on CUDA)
    max_num_seqs: int  # most sequences vLLM schedules together
    max_num_batched_tokens: int  # most tokens one scheduler step computes (prefill chunks and decodes together)
    max_model_len: int  # longest prompt + response in tokens (0: the model's max_position_embeddings)
    enforce_eager: bool  # run eagerly: no torch.compile or CUDA graphs (starts in seconds, not minutes)
    enable_prefix_caching: bool  # reuse the KV of shared prompt prefixes (a prompt's n samples prefill once)
    # KV-cache block in tokens (0: vLLM's default, 128 on CPU); prefix caching reuses whole blocks (multi-turn: 32)
    block_size: int

    def __post_init__(self) -> None:
        require_positive(self.kv_cache_gb, "kv_cache_gb")
        require_positive(self.max_num_seqs, "max_num_seqs")
        require_positive(self.max_num_batched_tokens, "max_num_batched_tokens")
        require(
            self.max_model_len >= 0, "max_model_len", f"must be >= 0 (0: the model's own), got {self.max_model_len}"
        )
        require(
            self.block_size >= 0 and self.block_size % 16 == 0,
            "block_size",
            f"must be 0 (vLLM's default) or a multiple of 16, got {self.block_size}",
            "on CPU vLLM prefers multiples of 32",
        )
