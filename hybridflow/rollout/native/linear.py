"""A weight matrix for y = x W^T + b, multiplied in the layout the backend runs fastest.

On CPU in bf16 the product goes through oneDNN with the weight reordered once ("packed")
into its blocked layout, instead of being reordered inside every call; that is 15-25 %
faster for the small batches of decode, and bit-identical to `F.linear`. Elsewhere
(fp32, CUDA, and CPUs whose oneDNN has no bf16 reorder: those without AVX512 or AVX-NE-CONVERT,
e.g. AMD EPYC Milan) it is plain `F.linear`. The plain weight stays the tensor that updates are
written into; `repack` refreshes the packed copy in place afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

_BATCH_HINT = 64  # the batch size oneDNN picks the packed layout for (any batch size works)


@cache
def cpu_packs_bf16() -> bool:
    """Whether oneDNN on this CPU can pack bf16 weights (it refuses without AVX512/AVX-NE-CONVERT)."""
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), _BATCH_HINT)
    except RuntimeError:
        return False
    return True


class Matrix:
    """weight (N, K) and optional bias (N,); calling it maps (..., K) -> (..., N)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        self.adapter: LowRank | None = None  # a LoRA policy's adapters on this matrix, served (not merged)
        self.pack = pack and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_packs_bf16()

    def repack(self) -> None:
        """Bring the packed copy up to date with `weight` (call after writing into it)."""
        if not self.pack:
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _BATCH_HINT)  # nothing else holds the old

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.adapter is None else self.adapter.add_to(y, x)


class ExpertMatrices:
    """A mixture's expert weights, gate_up (E, 2I, H) and down (E, H, I), as one ``Matrix`` per expert over its slice
    of them (so packed for oneDNN as a dense layer's are: 1.6-1.8x faster products than ``F.linear`` on the rows
    routed to an expert in decode, and bit-identical). ``repack`` after writing into the weights."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up = [Matrix(weight) for weight in gate_up]
        self.down = [Matrix(weight) for weight in down]

    def repack(self) -> None:
        for matrix in (*self.gate_up, *self.down):
            matrix.repack()


@dataclass
class AdapterBlock:
    """One adapted layer inside a (possibly fused) matrix: its rows of the output, its columns of the
    stacked A, and its B."""

    rows: slice
    columns: slice
    lora_b: torch.Tensor  # (rows, rank)


@dataclass
class LowRank:
    """LoRA adapters served on one matrix: y[:, rows] += scaling · (x A^T) B^T for each adapted layer in it.
    The A of every layer fused into the matrix are stacked, so their shared input is multiplied once."""

    lora_a: torch.Tensor  # (sum of ranks, K): the A of each block, stacked
    blocks: list[AdapterBlock]
    scaling: float

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        down = F.linear(x, self.lora_a)
        for block in self.blocks:
            y[..., block.rows].add_(F.linear(down[..., block.columns], block.lora_b), alpha=self.scaling)
        return y


@dataclass
class ExpertLowRank:
    """LoRA adapters served on one of a mixture's expert weights (E, out, in): the rows routed to expert e add
    scaling · (x A_e^T) B_e^T to their product with W_e."""

    lora_a: torch.Tensor  # (E, r, in)
    lora_b: torch.Tensor  # (E, out, r)
    scaling: float

    def add_to(self, y: torch.Tensor, x: torch.Tensor, expert: int) -> torch.Tensor:
        return y.add_(F.linear(F.linear(x, self.lora_a[expert]), self.lora_b[expert]), alpha=self.scaling)
