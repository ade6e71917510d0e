"""The native engine's settings (`actor_rollout_ref.rollout.native.*`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.validation import require, require_positive

ADAPTER_MODES = ("served", "merged")


@dataclass(kw_only=True)
class NativeEngineConfig:
    max_num_seqs: int  # most sequences decoded together: the KV cache has that many slots
    max_prefill_tokens: int  # most (padded) prompt tokens in one prefill forward
    min_shared_prefix: int  # a common prefix of the prompts shorter than this is not computed separately
    # a LoRA policy's adapters: served (applied at each matmul, the base never rewritten) | merged (W + s·BA
    # written into the engine's weights from a kept copy of the base)
    adapters: str
    # while generating, use as many torch threads as cores other processes leave free (at most the worker's
    # threads): a thread sharing its core with a busy process stalls every op (rollout/native/cpu_share.py)
    follow_free_cores: bool
    # decode attends over each sequence's real length with a small C++ kernel (compiled on first use, about 25 s;
    # rollout/native/ragged_attention.py) instead of over its cache slot's whole preallocated row; CPU only, and
    # whole rows where no compiler is found
    ragged_decode: bool
    # between generation calls the KV cache is freed for training (false) or kept for the next call of its shape
    # (true): a new cache's pages are committed as its first writes touch them, about 0.1 s a GRPO step for SmolLM2 on
    # 2 cores; a kept one holds the pages its calls wrote; null: kept on CPU, freed on a GPU
    keep_cache: bool | None

    def __post_init__(self) -> None:
        require_positive(self.max_num_seqs, "max_num_seqs")
        require_positive(self.max_prefill_tokens, "max_prefill_tokens")
        require(
            self.adapters in ADAPTER_MODES,
            "adapters",
            f"must be one of {list(ADAPTER_MODES)}, got {self.adapters!r}",
        )
        require(self.min_shared_prefix >= 1, "min_shared_prefix", f"must be >= 1, got {self.min_shared_prefix}")
