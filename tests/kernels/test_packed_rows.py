"""kernels/packed_rows.py: the packed attention's gathers into rows and back to tokens give torch's ops' values and
autograd's gradients bit for bit (index_select, the copy into the matmul's layout, index_add_ backward), with shared
prompt tokens summed over every row that holds them, on 1 and 2 threads."""

import pytest
import torch

from hybridflow.kernels import packed_rows

ROWS, LENGTH = 5, 7


def _slots(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows of 3-7 tokens, rows 0-2 sharing a 3-token prompt (as the packing shares prompts), the slots after a row's
    end pointing at one token (the packing points them at its first). Returns (slots (ROWS * LENGTH,), real (N,), N)."""
    lengths = [7, 5, 6, 3, 4]
    index, real, next_token = torch.zeros(ROWS, LENGTH, dtype=torch.long), [], 0
    for row, length in enumerate(lengths):
        start = 0
        if 0 < row < 3:  # the first three tokens are row 0's
            index[row, :3] = index[0, :3]
            start = 3
        for position in range(start, length):
            index[row, position] = next_token
            real.append(row * LENGTH + position)
            next_token += 1
    order = torch.randperm(next_token, generator=generator)  # tokens in any order of the sequence
    index = order[index.flatten()]
    real_by_token = torch.empty(next_token, dtype=torch.long)
    real_by_token[order] = torch.tensor(real)
    return index, real_by_token, next_token


def _equal_with_gradients(got, expected, leaf, expected_leaf, generator) -> None:
    """The same values, and after the same backward the same gradients, signs of zeros included."""
    assert torch.equal(got, expected)
    grad = _values(got.shape, got.dtype, generator)
    got.backward(grad)
    expected.backward(grad)
    assert torch.equal(leaf.grad, expected_leaf.grad)
    assert torch.equal(leaf.grad.signbit(), expected_leaf.grad.signbit())


def _values(shape, dtype, generator) -> torch.Tensor:
    values = torch.randn(shape, generator=generator).to(dtype)
    values.view(-1)[::7] = -0.0  # signed zeros: index_add_ into zeros makes them +0
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transpose", [False, True])
def test_rows_are_index_select_and_their_gradient_index_add(transpose, dtype, threads):
    generator = torch.Generator().manual_seed(0)
    slots, _, tokens = _slots(generator)
    heads, d = 3, 40  # d over one task's span of 32
    for layout in ("tokens first", "heads first"):  # q after rotary is laid out by token; either must work
        base = _values((tokens, heads, d) if layout == "tokens first" else (heads, tokens, d), dtype, generator)
        x = (base.transpose(0, 1) if layout == "tokens first" else base)[None].requires_grad_()
        expected_x = x.detach().clone().requires_grad_()
        got = packed_rows.rows(x, slots, ROWS, transpose=transpose)
        expected = expected_x[0].index_select(1, slots).unflatten(1, (ROWS, LENGTH)).transpose(0, 1)
        if transpose:
            expected = expected.transpose(-1, -2)
        assert got.is_contiguous()
        _equal_with_gradients(got, expected, x, expected_x, generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_take_each_ones_slot_and_scatter_the_gradient_back(dtype, threads):
    generator = torch.Generator().manual_seed(1)
    _, real, tokens = _slots(generator)
    heads, d = 4, 16
    y = _values((ROWS, heads, LENGTH, d), dtype, generator).requires_grad_()
    expected_y = y.detach().clone().requires_grad_()
    got = packed_rows.tokens(y, real)
    expected = expected_y.transpose(1, 2).flatten(0, 1).index_select(0, real)[None]
    assert got.shape == (1, tokens, heads, d)
    _equal_with_gradients(got, expected, y, expected_y, generator)


def test_an_index_outside_the_tokens_is_refused():
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match=r"out of \[0, 4\)"):
        packed_rows.rows(x, torch.tensor([0, 1, 4, 2]), 2)
    with pytest.raises(RuntimeError, match=r"out of \[0, 6\)"):
        packed_rows.tokens(torch.zeros(2, 2, 3, 8), torch.tensor([0, 6]))
