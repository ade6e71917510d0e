"""The training pass's work between its matmuls as autograd functions over one fused C++ kernel each way
(csrc/train_elementwise.cpp, csrc/train_softmax.cpp, csrc/train_rotary.cpp): RMSNorm, SiLU(gate) * up, the rotary
embedding, and the packed attention's scaled causal softmax.

transformers' RMSNorm is about 8 torch ops forward and 15 backward, most of them passes over float32 copies of the
(tokens, hidden) activations; SiLU x up is 2 forward and 4 backward, and keeps SiLU(gate) for the backward. Here each
is one pass forward and one or two backward (plus torch's own reductions on the products the backward needs), and
SiLU x up keeps only its inputs; the rotary embedding (x * cos + rotate_half(x) * sin, six ops forward and about ten
backward) is one pass each way. The values are bit for bit those of the torch ops and of autograd's backward through
them (tests/kernels/test_elementwise.py): a model computes the same numbers with the fused functions or without.
The attention's softmax (engine/packing.py) is torch.softmax(bias + scale * scores) in float32, then rounded: four
passes over the (rows, heads, L, L) scores forward and four backward, in one each here.
"""

from __future__ import annotations

import torch

from hybridflow.kernels import build


class _RMSNorm(torch.autograd.Function):
    """x's gradient: one tensor in bfloat16; in float32 two, its two terms, given to autograd as the gradients of
    two inputs that are both x (``x_again``), so that autograd adds them to x's other gradients in the order it adds
    the two terms of transformers' ops (csrc/train_elementwise.cpp, ``split``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, x_again: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out, inverse = build.module().rms_norm_forward(rows, weight.contiguous(), eps)
        ctx.save_for_backward(rows, weight, inverse)
        ctx.split, ctx.shape = x_again is not None, x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weight, inverse = ctx.saved_tensors
        # a gradient laid out otherwise (q/k norms before a transpose): torch sums the weight's in that layout's order
        in_rows = grad.is_contiguous()
        *dx, dweight = build.module().rms_norm_backward(
            grad.contiguous().view(rows.shape), rows, weight.contiguous(), inverse, ctx.split, in_rows
        )
        if not in_rows:
            normed = (rows.float() * inverse[:, None]).to(rows.dtype).view(ctx.shape)
            dweight = (grad * normed).sum_to_size(weight.shape)
        dx = [part.view(ctx.shape) for part in dx]
        return dx[0], dx[1] if ctx.split else None, dweight, None


class _SiLUMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return build.module().silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return tuple(build.module().silu_mul_backward(grad.contiguous(), gate, up))


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return build.module().rotary_forward(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        # contiguous, as autograd's sum of the slices' gradients is: what comes next (a q/k norm's weight gradient,
        # summed in its gradient's layout) sees the same layout
        dx = torch.empty(grad.shape, dtype=grad.dtype)
        build.module().rotary_backward(grad if grad.stride(-1) == 1 else grad.contiguous(), cos, sin, dx)
        return dx, None, None


class _CausalSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, scores: torch.Tensor, bias: torch.Tensor, scale: float, offsets: torch.Tensor, queries: int
    ) -> torch.Tensor:
        rows = scores.reshape(-1, scores.shape[-1])
        probs, probs32 = build.module().causal_softmax_forward(rows, bias, scale, offsets, queries)
        ctx.save_for_backward(probs32)
        ctx.scale = scale
        return probs.view(scores.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (probs32,) = ctx.saved_tensors
        rows = grad.reshape(probs32.shape).contiguous()
        return build.module().causal_softmax_backward(rows, probs32, ctx.scale).view(grad.shape), None, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-style RMSNorm of x (..., H): weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype); x and
    weight of one dtype, float32 or bfloat16, on the CPU (``fits``)."""
    return _RMSNorm.apply(x, x if x.dtype == torch.float32 else None, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, two tensors of one shape and dtype (float32 or bfloat16) on the CPU (``fits``)."""
    return _SiLUMul.apply(gate, up)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding of q or k: x * cos + rotate_half(x) * sin, x (B, H, T, D) contiguous along D
    (any layout otherwise), cos and sin (B, T, D) contiguous, broadcast over the heads; one dtype, float32 or bfloat16,
    on the CPU (``fits``), cos and sin without gradients."""
    return _Rotary.apply(x, cos, sin)


def causal_softmax(
    scores: torch.Tensor, bias: torch.Tensor, scale: float, offsets: torch.Tensor | None = None, queries: int = 0
) -> torch.Tensor:
    """torch.softmax(torch.add(bias, scores, alpha=scale), -1).to(scores.dtype) for contiguous scores (..., L, L)
    whose rows are queries at positions 0..L-1 in turn (engine/packing.py's grouped (rows, kv heads, G * L, L)),
    bias (L, L) float32; float32 or bfloat16 scores on the CPU (``fits``).

    ``offsets`` (rows,) int64 and ``queries`` Q: scores (rows, kv heads, G * Q, L) whose row r's query j is at key
    position offsets[r] + j, masked by the bias's row there (the last row past the end): a causal mask that starts
    ``offsets[r]`` keys in (the responses' queries over their whole rows, engine/packing.py)."""
    if offsets is None:
        offsets, queries = torch.empty(0, dtype=torch.long, device=scores.device), scores.shape[-1]
    return _CausalSoftmax.apply(scores.contiguous(), bias, scale, offsets.contiguous(), queries)


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the fused functions take these tensors: plain (not DTensor) CPU tensors of one dtype, float32 or
    bfloat16, and the C++ module built."""
    first = tensors[0]
    if first.dtype not in (torch.float32, torch.bfloat16):
        return False
    if any(type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) for t in tensors):
        return False
    if any(t.device.type != "cpu" or t.dtype != first.dtype for t in tensors):
        return False
    return build.available()
