"""The native engine's KV cache on CPU: zeros that the OS commits only where written (an anonymous mapping), so a
cache sized for the longest conversation the budgets allow costs what its sequences use, and goes with its tensor;
kept between calls, it gives what a new one gives."""

import gc
import resource

import pytest
import torch
from rollout_helpers import QUESTIONS, engine_config, prompts_of, sampled
from transformers import AutoConfig

from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.kv_cache import KVCache, lazy_zeros
from hybridflow.rollout.native.spec import spec_from_config

MIB = 2**20


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / MIB


def test_lazy_zeros_are_zeros_committed_only_where_written():
    before = resident_mib()
    cache = lazy_zeros((4, 64, 2, 1024, 64), torch.bfloat16, "cpu")  # 128 MiB
    assert cache.shape == (4, 64, 2, 1024, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert resident_mib() - before < 16  # nothing committed yet
    cache[:, :8].fill_(1.5)  # an eighth of it written
    assert resident_mib() - before < 16 + 128 / 8 + 8
    assert float(cache[:, :8].float().mean()) == 1.5 and not cache[:, 8:].any()  # the rest reads as zeros
    cache.view(-1)[-1] = 2.0
    assert float(cache.view(-1)[-1]) == 2.0
    written = resident_mib()
    del cache
    gc.collect()
    assert resident_mib() < written - 8  # unmapped with the tensor


def test_lazy_zeros_of_a_float32_tensor_and_an_empty_one():
    assert torch.equal(lazy_zeros((3, 5), torch.float32, "cpu"), torch.zeros(3, 5))
    assert lazy_zeros((0, 4), torch.float32, "cpu").shape == (0, 4)


def filled_cache() -> KVCache:
    spec = spec_from_config(AutoConfig.from_pretrained(resolve_model_path("tiny-llama")))
    cache = KVCache(spec, num_slots=6, max_len=10, dtype=torch.bfloat16, device="cpu")
    generator = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    return cache


@pytest.mark.parametrize(
    ("src", "dst"),
    [([5, 5, 5, 5], [0, 1, 2, 3]), ([4, 5], [1, 0]), ([1, 2], [2, 3]), ([3, 0], [0, 3])],
    ids=["one source, four copies", "two moves", "a chain", "a swap"],
)
def test_copy_slots_copies_each_source_as_it_was_before_the_call(src, dst):
    cache = filled_cache()
    k, v = cache.k.clone(), cache.v.clone()
    cache.copy_slots(src, dst, length=7)
    expected_k, expected_v = k.clone(), v.clone()
    for source, target in zip(src, dst):  # every source read from the cache as it was (the chain and the swap)
        expected_k[:, target, :, :7] = k[:, source, :, :7]
        expected_v[:, target, :, :7] = v[:, source, :, :7]
    assert torch.equal(cache.k, expected_k) and torch.equal(cache.v, expected_v)


@pytest.mark.parametrize("ragged", [True, False], ids=["real-lengths", "whole-rows"])
def test_a_cache_kept_between_calls_gives_what_a_new_one_gives(ragged):
    """On CPU the engine keeps its cache after a call (keep_cache null) and the next call of its shape reuses it, stale
    keys and values in it: every output is as from a new engine's new cache. keep_cache=false frees it."""
    model = load_causal_lm("tiny-llama", dtype=torch.float32).eval()
    tokenizer = load_tokenizer("tiny-llama")
    first, second = prompts_of(tokenizer, QUESTIONS), prompts_of(tokenizer, QUESTIONS[::-1])  # one cache shape
    params = sampled(seed=3, max_new_tokens=8)
    kept = NativeRollout(model, tokenizer, engine_config=engine_config(ragged_decode=ragged))
    kept.generate_sequences(first, params)
    kept.release_cache()
    cache = kept.engine.cache
    assert cache is not None and cache.k.any()  # kept, holding the first call's keys
    got = kept.generate_sequences(second, params).batch
    assert kept.engine.cache is cache  # reused, not made again
    fresh = NativeRollout(model, tokenizer, engine_config=engine_config(ragged_decode=ragged))
    expected = fresh.generate_sequences(second, params).batch
    assert set(got.keys()) == set(expected.keys())
    for key in expected.keys():
        assert torch.equal(got[key], expected[key]), key
    fresh.engine.keep_cache = False
    fresh.release_cache()
    assert fresh.engine.cache is None
