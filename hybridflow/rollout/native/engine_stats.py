"""What one `Engine.generate` call did, counted: its forwards, tokens and slot moves (read by the rollout's
metrics and the benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters of the last `Engine.generate` call."""

    prefill_calls: int = 0  # prefill forwards
    prefill_sequences: int = 0  # prompts computed (one per group of identical prompts admitted together)
    prefill_tokens: int = 0  # real prompt tokens computed
    decode_steps: int = 0  # decode forwards
    decode_tokens: int = 0  # sequences summed over decode steps
    max_running: int = 0  # most sequences decoded together
    slot_moves: int = 0  # sequences moved down to close holes
    shared_prefix_tokens: int = 0  # length of the common prefix of all prompts, computed once
