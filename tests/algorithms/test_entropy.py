"""Entropy and log-probs from logits."""

import math

import torch

from hybridflow.algorithms import entropy_from_logits, log_probs_from_logits


def test_entropy_by_hand():
    # uniform over 4 → ln 4; softmax(0, ln 3) = (1/4, 3/4) → -(¼ ln ¼ + ¾ ln ¾)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])
    expected = torch.tensor([[math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    torch.testing.assert_close(entropy_from_logits(logits), expected)


def test_entropy_of_a_peaked_distribution_is_finite_and_near_zero():
    logits = torch.tensor([[1000.0, 0.0, -1000.0]])
    h = entropy_from_logits(logits)
    assert torch.isfinite(h).all() and abs(h.item()) < 1e-3


def test_entropy_matches_torch_categorical_with_gradients_and_chunks():
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)).requires_grad_(True)
    reference = torch.distributions.Categorical(logits=logits).entropy()
    (ref_grad,) = torch.autograd.grad(reference.sum(), logits)
    for chunk in [None, 3]:
        h = entropy_from_logits(logits, chunk_size=chunk)
        (grad,) = torch.autograd.grad(h.sum(), logits)
        torch.testing.assert_close(h, reference)
        torch.testing.assert_close(grad, ref_grad)


def test_entropy_of_bf16_logits_is_computed_in_float32():
    logits = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    h = entropy_from_logits(logits, chunk_size=4)
    assert h.dtype == torch.float32 and h.shape == (2, 3)
    torch.testing.assert_close(h, torch.full((2, 3), math.log(8.0)))


def test_entropy_over_a_real_vocabulary_is_float32_accurate():
    """SmolLM2's 49,152 tokens, bf16 logits: within 1e-4 of a float64 reference (a batched matmul contracting the
    probabilities with the logits lost 1e-3 here on CPU)."""
    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(64, 49_152, generator=gen)).bfloat16()
    z = logits.double()
    reference = torch.logsumexp(z, -1) - (z.softmax(-1) * z).sum(-1)
    for chunk in [None, 16]:
        got = entropy_from_logits(logits, chunk_size=chunk)
        assert (got.double() - reference).abs().max() < 1e-4


def test_log_probs_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])
    labels = torch.tensor([[1, 0]])
    # softmax(0, ln 3)[1] = 3/4; softmax(5, 5)[0] = 1/2
    expected = torch.tensor([[math.log(0.75), math.log(0.5)]])
    torch.testing.assert_close(log_probs_from_logits(logits, labels), expected)


def test_log_probs_match_log_softmax_with_chunks():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 9, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 9, (3, 4), generator=gen)
    reference = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    for chunk in [None, 5]:
        torch.testing.assert_close(log_probs_from_logits(logits, labels, chunk_size=chunk), reference)


def test_log_prob_backward_by_chunks_matches_autograd_of_log_softmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (7,), generator=gen)
    assert torch.autograd.gradcheck(lambda z: log_probs_from_logits(z, labels, chunk_size=3), (logits,))
    weights = torch.randn(7, generator=gen, dtype=torch.float64)
    (log_probs_from_logits(logits, labels, chunk_size=3) * weights).sum().backward()
    expected = weights[:, None] * (torch.nn.functional.one_hot(labels, 11) - logits.detach().softmax(-1))
    torch.testing.assert_close(logits.grad, expected)


def test_bf16_log_probs_are_float32_and_grads_keep_the_logits_dtype():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 2, 300, generator=gen) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 300, (5, 2), generator=gen)
    out = log_probs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    reference = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, reference)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    expected = torch.nn.functional.one_hot(labels, 300) - logits.detach().float().softmax(-1)
    torch.testing.assert_close(logits.grad.float(), expected, atol=4e-3, rtol=1e-2)
