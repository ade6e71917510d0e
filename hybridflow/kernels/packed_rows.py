"""The packed attention's moves between the packed sequence and its rows (engine/packing.py) as autograd functions over
csrc/packed_rows.cpp: ``rows`` gathers q, k or v from the tokens into the layout the batched matmuls take, ``tokens``
takes the attention's output back.

With torch's ops each move is an index_select and then a copy into the matmul's layout, and backward a zero-filled
``index_add_`` that adds one slot at a time; here each is one pass. The values and gradients are bit for bit torch's
(tests/kernels/test_packed_rows.py). ``elementwise.fits`` says where they run.
"""

from __future__ import annotations

import torch

from hybridflow.kernels import build


class _Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, slots: torch.Tensor, rows: int, transpose: bool) -> torch.Tensor:
        by_token = x[0].transpose(0, 1)  # (N, h, d)
        if by_token.stride(-1) != 1:
            by_token = by_token.contiguous()
        ctx.save_for_backward(slots)
        ctx.tokens, ctx.transpose = x.shape[2], transpose
        return build.module().rows_gather(by_token, slots, rows, transpose)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (slots,) = ctx.saved_tensors
        return (
            build.module().rows_scatter_add(grad.contiguous(), slots, ctx.tokens, ctx.transpose)[None],
            None,
            None,
            None,
        )


class _Tokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(real)
        ctx.rows, ctx.length = y.shape[0], y.shape[2]
        return build.module().rows_to_tokens(y.contiguous(), real)[None]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (real,) = ctx.saved_tensors
        return build.module().tokens_to_rows(grad[0].contiguous(), real, ctx.rows, ctx.length), None


def rows(x: torch.Tensor, slots: torch.Tensor, rows: int, transpose: bool = False) -> torch.Tensor:
    """x (1, h, N, d) of the packed tokens, any strides; slots (rows * L,) int64: each row's tokens in turn (the
    packing's ``Segments.index`` flattened) -> (rows, h, L, d) contiguous, or with ``transpose`` (rows, h, d, L):
    ``x[0].index_select(1, slots).unflatten(1, (rows, L)).transpose(0, 1)``, laid out for the matmul."""
    return _Rows.apply(x, slots, rows, transpose)


def tokens(y: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """y (rows, h, L, d); real (N,) int64, distinct: the slot (row * L + position) whose output each token takes ->
    (1, N, h, d): ``y.transpose(1, 2).flatten(0, 1).index_select(0, real)[None]``."""
    return _Tokens.apply(y, real)
