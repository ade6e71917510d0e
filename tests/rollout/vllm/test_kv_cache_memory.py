"""vLLM's KV cache on the CPU comes back zeroed after the trainer used its memory.

In a worker, freed memory is kept for reuse (controller/ray_runtime.py ALLOCATOR_ENV), so a KV cache grown back
after an update gets the memory of the update's tensors, contents included. vLLM's CPU attention reads a block's
unwritten slots with weight 0: NaN there made whole samples' log-probs NaN (tests/trainer/test_vllm_e2e.py, after
tests/rollout/vllm/ in the same test process). Checked in a process with the worker's allocator settings.
"""

import json
import os
import subprocess
import sys

import pytest

from hybridflow.controller.ray_runtime import ALLOCATOR_ENV

pytestmark = pytest.mark.slow

GROW_BACK = """
import json
import torch
from hybridflow.rollout.vllm.kv_cache import regrow_zeroed

def grown_back(grow, steps=4):
    cache = torch.zeros(64 * 2**20, dtype=torch.bfloat16)  # 128 MB, a small KV cache
    storage, nbytes = cache.untyped_storage(), cache.untyped_storage().nbytes()
    nans = nonzero = 0
    for _ in range(steps):  # released for an update that uses the memory, grown back, written by generation
        storage.resize_(0)
        update = [torch.full((n * 2**20,), float("nan"), dtype=torch.bfloat16) for n in (32, 64, 96, 64, 128)]
        del update
        grow(storage, nbytes)
        nans, nonzero = nans + int(cache.isnan().sum()), nonzero + int(cache.count_nonzero())
        cache.fill_(1.0)
    return [nans, nonzero]

print(json.dumps([grown_back(lambda storage, nbytes: storage.resize_(nbytes)), grown_back(regrow_zeroed)]))
"""


def test_the_kv_cache_grows_back_zeroed_where_the_update_left_nan():
    env = {**os.environ, **ALLOCATOR_ENV}  # a worker's: freed memory kept for reuse
    done = subprocess.run([sys.executable, "-c", GROW_BACK], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    (plain_nans, _), zeroed = json.loads(done.stdout)  # (NaN elements, non-zero elements) over four regrows
    assert plain_nans > 0  # a plain regrow in a worker: the update's NaN
    assert zeroed == [0, 0]
