"""The training pass's fused RMSNorm and SiLU x up (kernels/elementwise.py, csrc/train_elementwise.cpp): forward and
backward bit for bit transformers' modules and autograd's backward through them, in bf16 and fp32, on one and two
threads, at shapes with scalar tails and with more elements than one thread's span of torch's elementwise loops."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hybridflow.engine.row_attention import causal_bias
from hybridflow.kernels import elementwise

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 40), (1, 847, 576), (7, 130)])
def test_rms_norm_forward_and_backward_are_transformers_bit_for_bit(threads, dtype, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    hidden = shape[-1]
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator) * 0.3 + 1)
    x = (torch.randn(*shape, generator=generator) * 3).to(dtype).requires_grad_()
    grad = torch.randn(*shape, generator=generator).to(dtype)
    expected = norm(x)
    expected.backward(grad)
    expected_dx, expected_dweight = x.grad, norm.weight.grad

    x.grad = None
    weight = norm.weight.detach().clone().requires_grad_()
    out = elementwise.rms_norm(x, weight, 1e-5)
    out.backward(grad)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, expected)
    assert torch.equal(x.grad, expected_dx)
    assert torch.equal(weight.grad, expected_dweight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 40), (33, 1001), (1, 40, 1536)])  # 33 x 1001: two spans, both with tails
def test_silu_mul_forward_and_backward_are_torch_s_bit_for_bit(threads, dtype, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    gate = (torch.randn(*shape, generator=generator) * 4).to(dtype).requires_grad_()
    up = torch.randn(*shape, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(*shape, generator=generator).to(dtype)
    expected = F.silu(gate) * up
    expected.backward(grad)
    expected_grads = gate.grad, up.grad

    gate.grad = up.grad = None
    out = elementwise.silu_mul(gate, up)
    out.backward(grad)
    assert torch.equal(out, expected)
    assert torch.equal(gate.grad, expected_grads[0])
    assert torch.equal(up.grad, expected_grads[1])


def test_backward_takes_a_non_contiguous_gradient():
    """Autograd may hand a function a gradient view (a transpose's backward): the kernels take contiguous copies."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 24, generator=generator, requires_grad=True)
    weight = torch.randn(24, generator=generator, requires_grad=True)
    elementwise.rms_norm(x, weight, 1e-6).t().sum(0).backward(torch.arange(6.0))
    norm = LlamaRMSNorm(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
    y = x.detach().clone().requires_grad_()
    norm(y).t().sum(0).backward(torch.arange(6.0))
    assert torch.equal(x.grad, y.grad) and torch.equal(weight.grad, norm.weight.grad)


def test_fits_only_plain_cpu_tensors_of_one_supported_dtype():
    x = torch.ones(2, 4)
    assert elementwise.fits(x, torch.nn.Parameter(torch.ones(4)))
    assert not elementwise.fits(x, torch.ones(4, dtype=torch.bfloat16))  # mixed dtypes
    assert not elementwise.fits(x.half(), torch.ones(4).half())
    assert not elementwise.fits(x.double(), torch.ones(4).double())


# (b, kv heads, G, Q queries, L keys, queries offset per row)
SOFTMAX_SHAPES = [(32, 3, 3, 77, 77, False), (2, 1, 2, 5, 5, False), (3, 2, 1, 40, 40, False)]
SOFTMAX_SHAPES += [(2, 3, 3, 130, 130, False), (32, 3, 3, 30, 77, True), (2, 1, 2, 3, 5, True), (3, 2, 1, 17, 40, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_causal_softmax_forward_and_backward_are_torch_s_bit_for_bit(threads, dtype, shape):
    """engine/packing.py's attention softmax: bias + scale * scores in float32, softmax, rounded; and its backward.
    With offsets, the responses' queries over their whole rows: query j of row r at key position offsets[r] + j (the
    last key's mask past the end), against torch's ops on the bias's rows at those positions."""
    rows, kv_heads, groups, queries, length, offset = shape
    generator = torch.Generator().manual_seed(length)
    bias = causal_bias(length, torch.device("cpu"))
    offsets, mask = None, bias
    if offset:
        offsets = torch.randint(0, length, (rows,), generator=generator)
        offsets[0] = length - 1  # queries past the last key
        mask = bias[(offsets[:, None] + torch.arange(queries)).clamp(max=length - 1)][:, None, None]  # (b, 1, 1, Q, L)
    scores = (torch.randn(rows, kv_heads, groups * queries, length, generator=generator) * 8).to(dtype)
    scores.requires_grad_()
    grad = torch.randn(scores.shape, generator=generator).to(dtype)
    scaled = torch.add(mask, scores.view(rows, kv_heads, groups, queries, length), alpha=64**-0.5)
    expected = torch.softmax(scaled, dim=-1).to(dtype).view(scores.shape)
    expected.backward(grad)
    expected_grad = scores.grad

    scores.grad = None
    probs = elementwise.causal_softmax(scores, bias, 64**-0.5, offsets, queries)
    probs.backward(grad)
    assert torch.equal(probs, expected)
    assert torch.equal(scores.grad, expected_grad)


def test_causal_softmax_refuses_offsets_that_do_not_divide_the_scores():
    scores, bias = torch.zeros(2, 1, 3, 4), causal_bias(4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="whole number of 2-query blocks"):
        elementwise.causal_softmax(scores, bias, 1.0, torch.zeros(2, dtype=torch.long), 2)
