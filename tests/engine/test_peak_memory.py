"""The step's peak memory on CPU: the kernel's peak resident set, reset at the step's start."""

import torch

from hybridflow.engine.memory import peak_memory_gb, reset_peak_memory

CPU = torch.device("cpu")


def test_peak_counts_from_the_last_reset():
    big = torch.ones(300 * 2**20 // 4)  # 300 MiB, touched
    with_big = peak_memory_gb(CPU)
    del big
    reset_peak_memory(CPU)
    after_reset = peak_memory_gb(CPU)
    assert after_reset < with_big - 0.2  # the freed 300 MiB no longer count
    again = torch.ones(150 * 2**20 // 4)
    assert peak_memory_gb(CPU) > after_reset + 0.1
    del again
