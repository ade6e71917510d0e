"""The training pass's fused rotary embedding (kernels/elementwise.py ``rotary``, csrc/train_rotary.cpp): q and k
rotated, and their gradients, bit for bit transformers' ``apply_rotary_pos_emb`` and autograd's backward through it,
in bf16 and fp32, on one and two threads, for the layouts the attention hands it (a transposed view of the
projection's output, or contiguous heads) and head sizes on the vector path and off it."""

import pytest
import torch
from transformers.models.llama import modeling_llama

from hybridflow.kernels import elementwise

# the function as transformers wrote it (engine/fused_modules.py may have given the module's name the fused one)
TRANSFORMERS = getattr(modeling_llama.apply_rotary_pos_emb, "unfused", modeling_llama.apply_rotary_pos_emb)


def _inputs(batch, tokens, heads, dim, dtype, transposed, generator):
    def leaf(h):
        shape = (batch, tokens, h, dim) if transposed else (batch, h, tokens, dim)
        return (torch.randn(*shape, generator=generator) * 2).to(dtype).requires_grad_()

    def view(x):  # (B, H, T, D), as the attention computes it
        return x.transpose(1, 2) if transposed else x

    angles = torch.rand(batch, tokens, dim // 2, generator=generator) * 6
    angles = torch.cat([angles, angles], -1)
    return leaf(heads), leaf(max(heads // 3, 1)), view, angles.cos().to(dtype), angles.sin().to(dtype)


def _layout(x: torch.Tensor) -> tuple[int, ...]:
    """The strides that matter: those of dimensions longer than one."""
    return tuple(stride for size, stride in zip(x.shape, x.stride()) if size > 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "batch, tokens, heads, dim, transposed",
    [(1, 847, 9, 64, True), (2, 5, 3, 6, True), (1, 13, 4, 128, False), (3, 7, 6, 16, False)],
)
def test_rotary_forward_and_backward_are_transformers_bit_for_bit(
    threads, dtype, batch, tokens, heads, dim, transposed
):
    generator = torch.Generator().manual_seed(tokens + dim)
    q, k, view, cos, sin = _inputs(batch, tokens, heads, dim, dtype, transposed, generator)
    q_grad = torch.randn(view(q).shape, generator=generator).to(dtype)
    k_grad = torch.randn(view(k).shape, generator=generator).to(dtype).transpose(2, 3).contiguous().transpose(2, 3)

    def run(rotate) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        """The rotated q and k, and the gradients at rotate's inputs (what the layers before them receive)."""
        inputs, received = (view(q), view(k)), {}

        def keep(i: int, grad: torch.Tensor) -> None:  # returns None: the gradient itself goes on unchanged
            received[i] = grad.clone(memory_format=torch.preserve_format)

        for i, x in enumerate(inputs):
            x.register_hook(lambda grad, i=i: keep(i, grad))
        out = rotate(*inputs)
        torch.autograd.backward(out, [q_grad, k_grad])  # k's gradient not contiguous along D
        return out, [received[0], received[1]]

    expected, expected_grads = run(lambda q, k: TRANSFORMERS(q, k, cos, sin))
    rotated, grads = run(lambda q, k: (elementwise.rotary(q, cos, sin), elementwise.rotary(k, cos, sin)))
    for out, reference in zip(rotated, expected):
        assert out.dtype == dtype and _layout(out) == _layout(reference)
        assert torch.equal(out, reference)
    for grad, reference in zip(grads, expected_grads):
        assert _layout(grad) == _layout(reference)  # a q/k norm before it sums its weight's gradient in this layout
        assert torch.equal(grad, reference)


def test_rotary_refuses_what_it_cannot_take():
    x = torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous"):
        elementwise.rotary(x, torch.randn(1, 3, 4), torch.randn(1, 3, 4))
    with pytest.raises(RuntimeError, match="D even"):
        elementwise.rotary(torch.randn(1, 2, 3, 7), torch.randn(1, 3, 7), torch.randn(1, 3, 7))
