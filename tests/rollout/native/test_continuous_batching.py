"""Requests that wait for a slot and join a running batch get what they would get alone."""

import pytest
import torch
from rollout_helpers import engine_config, greedy, prompts_of, sampled

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.native import NativeRollout

LONG = "Tell me a long story about " + "numbers and letters, " * 12  # a prompt many times longer than "Hi"
QUESTIONS = ["Hi", LONG, "Add 17 and 25", "What is 2 + 3?", "x", LONG + " And then?"]


def _alone(rollout, tokenizer, params):
    return torch.cat(
        [rollout.generate_sequences(prompts_of(tokenizer, [q]), params).batch["responses"] for q in QUESTIONS]
    )


def _stop_token_spreading_lengths(runs: torch.Tensor) -> int:
    """The token whose first occurrence differs most between rows (responses (N, R)), as a stop token."""

    def lengths(token: int) -> set[int]:
        hits = (runs == token).int()
        return {int(h.argmax()) + 1 if h.any() else runs.shape[1] for h in hits}

    return max(sorted(set(runs.flatten().tolist())), key=lambda token: len(lengths(token)))


@pytest.fixture(scope="module")
def tiny_llama():
    # tiny-qwen2's greedy output is one repeated token, which cannot give different lengths
    return load_causal_lm("tiny-llama", dtype=torch.float32), load_tokenizer("tiny-llama")


@pytest.mark.parametrize("max_num_seqs, min_shared_prefix", [(2, 10**9), (3, 1)])
def test_requests_that_join_later_generate_what_they_generate_alone(tiny_llama, max_num_seqs, min_shared_prefix):
    model, tokenizer = tiny_llama
    # A stop token that some requests meet early and others late or never, so lengths differ widely.
    free = NativeRollout(model, tokenizer, engine_config=engine_config(), stop_token_ids=[])
    stop = _stop_token_spreading_lengths(
        free.generate_sequences(prompts_of(tokenizer, QUESTIONS), greedy(24)).batch["responses"]
    )
    rollout = NativeRollout(
        model,
        tokenizer,
        engine_config=engine_config(max_num_seqs=max_num_seqs, max_prefill_tokens=64),
        stop_token_ids=[stop],
    )
    rollout.engine.min_shared_prefix = min_shared_prefix
    alone = _alone(rollout, tokenizer, greedy(24))
    together = rollout.generate_sequences(prompts_of(tokenizer, QUESTIONS), greedy(24))
    assert torch.equal(together.batch["responses"], alone)
    lengths = together.batch["response_mask"].sum(1)
    assert len(set(lengths.tolist())) >= 3, lengths  # very different lengths
    stats = rollout.stats
    assert stats.max_running == max_num_seqs and stats.prefill_calls >= 3  # requests waited and joined later
    assert stats.slot_moves > 0  # finished sequences left holes that were closed
    assert (stats.shared_prefix_tokens > 0) == (min_shared_prefix == 1)
    assert stats.decode_tokens == int(lengths.sum()) - len(QUESTIONS)  # no decode step for a finished sequence


def test_samples_do_not_depend_on_how_requests_are_interleaved(tiny):
    _, model, tokenizer = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)
    params = sampled(seed=7, max_new_tokens=12)
    wide = (
        NativeRollout(model, tokenizer, engine_config=engine_config(max_num_seqs=64))
        .generate_sequences(prompts, params)
        .batch
    )
    narrow = (
        NativeRollout(model, tokenizer, engine_config=engine_config(max_num_seqs=2))
        .generate_sequences(prompts, params)
        .batch
    )
    assert torch.equal(wide["responses"], narrow["responses"])
    assert torch.allclose(wide["rollout_log_probs"], narrow["rollout_log_probs"], atol=1e-5)


def test_release_cache_frees_it_and_the_next_generation_reallocates(tiny):
    """With keep_cache=false (CPU keeps it by default: test_kv_cache.py)."""
    _, model, tokenizer = tiny
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config(keep_cache=False))
    prompts = prompts_of(tokenizer, QUESTIONS[:3])
    first = rollout.generate_sequences(prompts, greedy(5)).batch["responses"]
    assert rollout.engine.cache is not None
    rollout.release_cache()
    assert rollout.engine.cache is None
    assert torch.equal(rollout.generate_sequences(prompts, greedy(5)).batch["responses"], first)
