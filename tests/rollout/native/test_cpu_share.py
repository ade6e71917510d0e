"""The thread governor: the threads it picks for the cores left, and its reading of the other processes' CPU
use on the real machine (a child process that spins is seen; the count goes back at the end)."""

import subprocess
import sys
import time

import pytest
import torch

from hybridflow.rollout.native.cpu_share import ThreadGovernor, threads_for


@pytest.mark.parametrize(
    "others,cores,max_threads,expected",
    [(0.0, 2, 2, 2), (0.4, 2, 2, 2), (0.7, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1), (1.0, 8, 8, 7), (0.0, 8, 4, 4)],
)
def test_threads_for_the_cores_left(others, cores, max_threads, expected):
    assert threads_for(others, cores, max_threads) == expected


def test_a_spinning_process_is_seen_and_the_threads_come_back():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        governor = ThreadGovernor(interval_s=0.3)
        assert governor.enabled and governor.max_threads == 2
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.6)  # not this process's CPU: the spinner's (and whatever else runs)
            others = governor.others_cores()
        finally:
            spinner.kill()
            spinner.wait()
        assert others is not None and others >= 0.5
        assert governor.others_cores() is None  # a new mark: the next look waits interval_s
        governor.threads = 1
        torch.set_num_threads(1)
        governor.restore()
        assert torch.get_num_threads() == 2
        assert not ThreadGovernor(enabled=False).enabled
    finally:
        torch.set_num_threads(threads)
