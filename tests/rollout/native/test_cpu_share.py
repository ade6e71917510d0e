"""The thread governor: the threads it picks for the cores left, and its reading of the other processes' CPU
use on the real machine (a child process that spins is seen; the count goes back at the end)."""

import asyncio
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


def test_a_multi_turn_session_follows_the_free_cores_and_gives_the_threads_back(monkeypatch):
    """The request engine (sessions.py) ticks the governor at each step: with a spinning process beside it the
    decode steps run on one thread, and the session's end restores two."""
    from rollout_helpers import engine_config, greedy

    from hybridflow.models import load_causal_lm, load_tokenizer
    from hybridflow.rollout.native import NativeRollout, model

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    decode = model.decode

    def watched_decode(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return decode(*args, **kwargs)

    monkeypatch.setattr(model, "decode", watched_decode)
    rollout = NativeRollout(load_causal_lm("tiny-llama"), load_tokenizer("tiny-llama"), engine_config=engine_config())
    engine = rollout.request_engine()

    async def serve():
        async with engine.serving(greedy(), max_len=128, max_requests=1):
            engine.governor.interval_s = 0.02  # look often: the tiny model's turns are short
            for _ in range(4):
                await engine.generate(0, [5, 6, 7], 20)
                await asyncio.sleep(0.05)  # a tool's run: the spinner keeps its core meanwhile

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)
        asyncio.run(serve())
    finally:
        spinner.kill()
        spinner.wait()
        restored = torch.get_num_threads()
        torch.set_num_threads(threads)
    assert engine.governor.max_threads == 2  # the session started on the worker's two threads,
    assert 1 in seen  # its decode steps followed the one free core,
    assert restored == 2  # and its end gave the two back
