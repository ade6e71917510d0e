"""The step's peak memory on CPU: the kernel's peak resident set, reset at the step's start.

The memory is mapped and unmapped directly (mmap), so that what the test frees goes back to the
kernel whatever the allocator's state after earlier tests in the same process.
"""

import mmap

import torch

from hybridflow.engine.memory import peak_memory_gb, reset_peak_memory

CPU = torch.device("cpu")
MiB = 2**20


def resident(size: int) -> mmap.mmap:
    """``size`` bytes of anonymous memory, every page touched (so resident)."""
    block = mmap.mmap(-1, size)
    page = b"\x01" * MiB
    for _ in range(size // MiB):
        block.write(page)
    return block


def test_peak_counts_from_the_last_reset():
    reset_peak_memory(CPU)
    big = resident(300 * MiB)
    with_big = peak_memory_gb(CPU)
    big.close()
    reset_peak_memory(CPU)
    after_reset = peak_memory_gb(CPU)
    assert after_reset < with_big - 0.2  # the freed 300 MiB no longer count
    again = resident(150 * MiB)
    assert peak_memory_gb(CPU) > after_reset + 0.1
    again.close()
