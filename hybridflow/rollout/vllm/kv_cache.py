"""Freeing vLLM's KV cache while the trainer uses the memory, and bringing it back before generating.

On CUDA (and other platforms with vLLM's sleep mode) this is vLLM's own `sleep(level=1)` /
`wake_up()`: the cache is discarded and the weights wait in CPU memory. vLLM's CPU backend has no
sleep mode, so there the storage behind every KV-cache tensor is shrunk to nothing and grown back
to its size before the next generation (the tensors, and vLLM's references to them, stay valid), and
zeroed, as vLLM made it: grown storage holds whatever the allocator's memory held last (the trainer's
activations and gradients), and vLLM's CPU attention reads a block's unwritten slots with weight 0,
which gives NaN where the garbage is NaN or infinite (whole samples with NaN log-probs, seen in
tests/trainer/test_vllm_e2e.py). Cached prompt prefixes are dropped on release, since their keys and
values are gone.
"""

from __future__ import annotations

import torch


def regrow_zeroed(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Grow a released storage back to ``nbytes``, zeroed as when vLLM allocated it (grown memory holds what the
    allocator last held there: in a worker, the trainer's tensors)."""
    storage.resize_(nbytes)
    torch.empty(0, dtype=torch.uint8).set_(storage).zero_()


def _kv_cache_tensors(worker) -> list[torch.Tensor]:
    """Run inside vLLM's worker (collective_rpc): the KV-cache tensors of its model runner."""
    return list(worker.model_runner.kv_caches)


class CacheMemory:
    """Release / restore of one in-process vLLM engine's KV cache; both are idempotent."""

    @staticmethod
    def sleep_mode_available() -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_sleep_mode_available()

    def __init__(self, llm):
        self.llm = llm
        self.sleep_mode = self.sleep_mode_available()
        self.released = False
        storages: dict[int, torch.UntypedStorage] = {}
        if not self.sleep_mode:
            (tensors,) = llm.collective_rpc(_kv_cache_tensors)
            for tensor in tensors:
                storage = tensor.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage)
        self.storages = list(storages.values())
        self.sizes = [storage.nbytes() for storage in self.storages]

    @property
    def nbytes(self) -> int:
        """The KV cache's size when held (CPU backend; 0 where vLLM's sleep mode manages it)."""
        return sum(self.sizes)

    def held_bytes(self) -> int:
        """The bytes the KV-cache storages hold now (CPU backend)."""
        return sum(storage.nbytes() for storage in self.storages)

    def release(self) -> None:
        if self.released:
            return
        self.llm.reset_prefix_cache()
        if self.sleep_mode:
            self.llm.sleep(level=1)
        else:
            for storage in self.storages:
                storage.resize_(0)
        self.released = True

    def restore(self) -> None:
        if not self.released:
            return
        if self.sleep_mode:
            self.llm.wake_up()
        else:
            for storage, size in zip(self.storages, self.sizes):
                regrow_zeroed(storage, size)
        self.released = False
