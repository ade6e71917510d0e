"""Shared prefill of the n samples of a prompt, seeding, top-k / top-p, and stopping on EOS."""

import pytest
import torch
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of, sampled

from hybridflow.rollout.base import response_mask_from
from hybridflow.rollout.native import NativeRollout
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


def test_sampler_frequencies_top_k_and_top_p():
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
def test_inverse_cdf_draws_follow_the_distribution_and_skip_impossible_tokens(vocab):
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
