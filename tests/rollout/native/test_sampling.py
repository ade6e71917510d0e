"""Shared prefill of the n samples of a prompt, seeding, top-k / top-p, stopping on EOS, and the untruncated draw in
one C++ call against torch's ops and a float64 reference."""

import pytest
import torch
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of, sampled

from hybridflow.kernels import build as kernels
from hybridflow.rollout.base import response_mask_from
from hybridflow.rollout.native import NativeRollout, sampler
from hybridflow.rollout.native.sampler import sample, uniforms


@pytest.fixture(scope="module")
def rollout(tiny):
    _, model, tokenizer = tiny
    return NativeRollout(model, tokenizer, engine_config=engine_config())


def test_the_n_samples_of_a_prompt_share_one_prefill(rollout):
    prompts = prompts_of(rollout.tokenizer, QUESTIONS[:3]).repeat(4, interleave=True)  # as the trainer repeats them
    out = rollout.generate_sequences(prompts, sampled(seed=1)).batch["responses"]
    assert rollout.stats.prefill_sequences == 3
    assert len({tuple(r.tolist()) for r in out[:4]}) > 1  # the four samples of one prompt differ


def test_sampling_is_reproducible_by_seed(rollout):
    prompts = prompts_of(rollout.tokenizer, QUESTIONS).repeat(2, interleave=True)
    first = rollout.generate_sequences(prompts, sampled(seed=11)).batch
    again = rollout.generate_sequences(prompts, sampled(seed=11)).batch
    other = rollout.generate_sequences(prompts, sampled(seed=12)).batch
    assert torch.equal(first["responses"], again["responses"])
    assert torch.equal(first["rollout_log_probs"], again["rollout_log_probs"])
    assert not torch.equal(first["responses"], other["responses"])


def test_requests_of_several_seeds_batched_sample_as_each_would_alone(rollout):
    """generate_tokens with a seed and a stream per prompt (the training service batching its clients' requests)."""
    prompt_ids = prompts_of(rollout.tokenizer, QUESTIONS[:2]).batch["input_ids"].tolist()
    params = sampled(seed=0)
    alone = rollout.generate_tokens([prompt_ids[0]] * 2, sampled(seed=5)) + rollout.generate_tokens(
        [prompt_ids[1]], sampled(seed=9)
    )
    together = rollout.generate_tokens(
        [prompt_ids[0], prompt_ids[0], prompt_ids[1]], params, seeds=[5, 5, 9], streams=[0, 1, 0]
    )
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    for batched, single in zip(together, alone):
        assert batched.log_probs == pytest.approx(single.log_probs, abs=1e-5)
    assert together[0].tokens != together[1].tokens  # two streams of one seed differ


def test_top_k_1_is_greedy(rollout):
    prompts = prompts_of(rollout.tokenizer, QUESTIONS)
    expected = rollout.generate_sequences(prompts, greedy(8)).batch["responses"]
    top1 = rollout.generate_sequences(prompts, sampled(seed=3, temperature=0.7, top_k=1)).batch["responses"]
    assert torch.equal(top1, expected)


def test_stopping_on_eos_masks_like_response_mask_from(tiny):
    _, model, tokenizer = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)
    free = (
        NativeRollout(model, tokenizer, engine_config=engine_config(), stop_token_ids=[])
        .generate_sequences(prompts, greedy(12))
        .batch
    )
    eos = int(free["responses"][1, 4])  # pretend a token that request 1 generates is the EOS
    model.generation_config.eos_token_id = eos
    try:
        stopped = (
            NativeRollout(model, tokenizer, engine_config=engine_config()).generate_sequences(prompts, greedy(12)).batch
        )
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    rollout_eos = [eos, tokenizer.eos_token_id]
    expected_mask = response_mask_from(free["responses"], rollout_eos)
    assert torch.equal(stopped["response_mask"], expected_mask)
    assert expected_mask[1].sum() <= 5
    kept = expected_mask.bool()
    assert torch.equal(stopped["responses"][kept], free["responses"][kept])
    assert (stopped["responses"][~kept] == tokenizer.pad_token_id).all()
    assert (stopped["rollout_log_probs"][~kept] == 0).all()


def test_uniforms_are_uniform_and_depend_on_seed_request_and_step():
    requests = torch.arange(20_000)
    u = uniforms(5, requests, torch.zeros_like(requests))
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - 2000).abs().max() < 200  # about 4.5 standard deviations
    assert not torch.equal(u, uniforms(6, requests, torch.zeros_like(requests)))
    assert not torch.equal(u, uniforms(5, requests, torch.ones_like(requests)))
    assert torch.equal(u[7:8], uniforms(5, torch.tensor([7]), torch.tensor([0])))


@pytest.fixture(params=["fused", "torch"])
def draw_path(request, monkeypatch):
    """The untruncated draw through the C++ kernel (kernels/csrc/sampling.cpp) or through torch's ops."""
    if request.param == "fused":
        assert kernels.available(), kernels.unavailable_reason()
    else:
        monkeypatch.setattr(sampler, "fused_draw_fits", lambda logits: False)
    return request.param


def test_sampler_frequencies_top_k_and_top_p(draw_path):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    logits = probs.log().expand(n, 4)
    requests, steps = torch.arange(n), torch.zeros(n, dtype=torch.long)
    freq = lambda tokens: torch.bincount(tokens, minlength=4).float() / n  # noqa: E731
    full, log_probs = sample(logits, sampled(seed=0), requests, steps)
    assert torch.allclose(freq(full), probs, atol=0.015)
    assert torch.allclose(log_probs, probs.log()[full], atol=1e-6)  # untruncated log-probs
    top2, _ = sample(logits, sampled(seed=0, top_k=2), requests, steps)
    assert torch.allclose(freq(top2), torch.tensor([0.625, 0.375, 0, 0]), atol=0.015)
    # top_p = 0.7: 0.5 alone is below it, 0.5 + 0.3 reaches it, so the nucleus is {0, 1}
    nucleus, _ = sample(logits, sampled(seed=0, top_p=0.7), requests, steps)
    assert torch.allclose(freq(nucleus), torch.tensor([0.625, 0.375, 0, 0]), atol=0.015)
    hot, _ = sample(logits, sampled(seed=0, temperature=0.5), requests, steps)
    sharpened = probs**2 / (probs**2).sum()
    assert torch.allclose(freq(hot), sharpened, atol=0.015)


@pytest.mark.parametrize("vocab", [1024, 1000, 999], ids=["blocks-of-1024", "blocks-of-8", "odd"])
def test_inverse_cdf_draws_follow_the_distribution_and_skip_impossible_tokens(vocab, draw_path):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=generator) * 2
    logits[::3] = float("-inf")  # impossible tokens, spread over every block
    n = 20_000
    tokens, log_probs = sample(
        logits.expand(n, vocab), sampled(seed=2), torch.arange(n), torch.zeros(n, dtype=torch.long)
    )
    probs = logits.softmax(-1)
    assert (probs[tokens] > 0).all()
    freq = torch.bincount(tokens, minlength=vocab).float() / n
    assert (freq - probs).abs().max() < 0.01
    assert torch.allclose(log_probs, probs.log()[tokens], atol=1e-5)


def float64_cdf(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The cumulative distribution of softmax(logits / temperature) in float64, ending at 1."""
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(-1)
    return cdf / cdf[:, -1:]


def interval(cdf: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token's cdf interval (lo, hi]."""
    lo = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    return lo, cdf.gather(1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab", [49_152, 1_000, 5], ids=["smollm2", "tail-of-vectors", "tiny"])
def test_untruncated_draw_is_the_float64_inverse_cdf_token(draw_path, dtype, vocab):
    """Every draw takes the token whose float64 cdf interval holds u, or, within a rounding error of the boundary, its
    neighbour; the log-probs equal float64's."""
    generator = torch.Generator().manual_seed(vocab)
    other, far = 0, 0
    for seed in range(6):
        logits = (torch.randn(64, vocab, generator=generator) * 4).to(dtype)
        requests, steps = torch.arange(64), torch.full((64,), seed)
        for temperature in (1.0, 0.7):
            tokens, log_probs = sample(logits, sampled(seed=seed, temperature=temperature), requests, steps)
            u = uniforms(seed, requests, steps).double()
            cdf = float64_cdf(logits, temperature)
            expected = torch.searchsorted(cdf, u[:, None])[:, 0].clamp(max=vocab - 1)
            lo, hi = interval(cdf, tokens)  # a different token only where u lies within 1e-5 of its interval
            other += int((tokens != expected).sum())
            far += int(((tokens != expected) & ((u - hi > 1e-5) | (lo - u > 1e-5))).sum())
            reference = torch.log_softmax(logits.double() / temperature, -1).gather(1, tokens[:, None])[:, 0]
            torch.testing.assert_close(log_probs.double(), reference, rtol=1e-5, atol=2e-5)
    assert far == 0
    assert other <= 768 * 0.005  # boundary cases are rare: at most 0.5 % of the 768 draws


def test_fused_draw_takes_no_masked_token_at_the_ends_of_the_distribution():
    """u near 0 and near 1 (and at 0 and 1) with -inf logits at both ends of the vocabulary and around a block's edge:
    only tokens with mass are drawn; a row of -inf only draws its first token with a NaN log-prob instead of failing."""
    logits = torch.full((4, 3000), float("-inf"))
    logits[:, 1500] = 0.0
    logits[:, 1023] = 1.0  # the first block's last token
    logits[:, 2049] = -1.0
    logits[3] = float("-inf")
    u = torch.tensor([1e-7, 0.78, 1 - 1e-7, 0.5])  # token 1500's interval is about (0.67, 0.91]
    tokens, log_probs = kernels.module().sample_rows(logits, u, 1.0)
    assert tokens[:3].tolist() == [1023, 1500, 2049]
    expected = torch.log_softmax(logits[0].double(), -1)[[1023, 1500, 2049]].float()
    torch.testing.assert_close(log_probs[:3], expected)
    assert tokens[3].item() == 0 and log_probs[3].isnan()
    # u at 0 and 1 exactly, the first block without mass: the first and the last token with mass
    logits[:2] = float("-inf")
    logits[:2, [1500, 2049]] = 0.0
    tokens, _ = kernels.module().sample_rows(logits[:2].contiguous(), torch.tensor([0.0, 1.0]), 1.0)
    assert tokens.tolist() == [1500, 2049]


def test_fused_draw_refuses_mismatched_inputs():
    logits = torch.zeros(4, 10)
    with pytest.raises(RuntimeError, match="u must be a contiguous"):
        kernels.module().sample_rows(logits, torch.full((3,), 0.5), 1.0)
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        kernels.module().sample_rows(logits, torch.full((4,), 0.5), 0.0)
    with pytest.raises(RuntimeError, match="logits must be a contiguous"):
        kernels.module().sample_rows(logits.t(), torch.full((10,), 0.5), 1.0)
