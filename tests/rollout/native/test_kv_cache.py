"""The native engine's KV cache on CPU: zeros that the OS commits only where written (an anonymous mapping), so a
cache sized for the longest conversation the budgets allow costs what its sequences use, and goes with its tensor."""

import gc
import resource

import torch

from hybridflow.rollout.native.kv_cache import lazy_zeros

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
