"""Decode attention that reads each sequence's real length of the KV cache, not its whole preallocated row.

In multi-turn rollout a slot is allocated for the longest conversation the turn budget allows, while the
conversations decoding at any moment are much shorter; torch's batched matmuls over whole rows read
(and multiply) every preallocated position, and over a slice of the rows they copy it first
(docs/results.md). A small C++ kernel (kernels/csrc/ragged_decode.cpp, compiled on first use with torch's extension
builder, then cached: kernels/build.py) reads keys and values in place, position 0..length-1 of each slot, and sums
products in float32. In float32 and bfloat16 one call runs both passes and, between them, the softmax torch's kernel
computes (the same numbers: scores and probabilities rounded to the dtype, as the whole-row path's batched matmuls
round them), each (sequence, kv head) on one thread, with its values fetched while its scores are computed; other
dtypes run the passes apart with torch's softmax between them.

The build needs a C++ compiler; where there is none (or it fails), ``available()`` is False with the
reason in ``unavailable_reason()``, and the engine attends over whole rows as before.
"""

from __future__ import annotations

import torch

from hybridflow.kernels.build import available, module, unavailable_reason

__all__ = ["available", "decode_attention", "module", "unavailable_reason"]


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """softmax(scale * q.k) v over positions 0..lengths[b]-1 of cache slot slots[b] (default: slot b).

    q (B, Hkv, G, D); keys/values one cache layer (S, Hkv, T, D); lengths (B,) int64 in 1..T; slots (B,)
    int64 in 0..S-1, several queries may read one slot (the tokens of one sequence in an extend); width:
    max(lengths) (a step's layers share it: give it once). Returns (B, Hkv, G, D) in q's dtype.
    """
    kernels = module()
    if slots is None:
        slots = torch.arange(q.shape[0], device=q.device)
    if width is None:
        width = int(lengths.max())
    if q.dtype in (torch.float32, torch.bfloat16):  # the same numbers as below, in one call (no scores tensor)
        return kernels.attend(q.contiguous(), keys, values, lengths, slots, width, scale)
    scores = kernels.scores(q.contiguous(), keys, lengths, slots, width, scale)  # (B, Hkv, G, width) float32
    # scores and probabilities rounded to q's dtype, as the batched matmuls over whole rows round them (bf16): the
    # two paths then differ by the order of the float32 sums alone, and generation by which one ran hardly at all
    probs = torch.softmax(scores.to(q.dtype), dim=-1).float()
    return kernels.values(probs, values, lengths, slots)
