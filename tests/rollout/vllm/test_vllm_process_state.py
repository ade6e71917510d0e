"""Starting vLLM in the trainer's process leaves that process as it was: threads, random streams, and the
loader variables every process it starts later (Ray's raylet and workers, tools) would inherit.

Run in a fresh interpreter: vLLM's first import is part of what is checked, and this one has imported it."""

import json
import os
import subprocess
import sys

import pytest
from conftest import tiny_head32_path

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, os, random, sys
import torch

LOADER = ("LD_PRELOAD", "LD_LIBRARY_PATH")
os.environ["LD_PRELOAD"] = ""  # set but empty, as a user's shell may have it; LD_LIBRARY_PATH unset
os.environ.pop("LD_LIBRARY_PATH", None)
before = {key: os.environ.get(key) for key in LOADER}
torch.set_num_threads(2)

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.vllm.install import unsupported_head_size
from hybridflow.rollout.vllm.rollout import VllmRollout
from hybridflow.trainer.setup.config import default_config

assert unsupported_head_size(32, "cpu") is None  # the config check's import of vLLM, before Ray starts
after_check = {key: os.environ.get(key) for key in LOADER}
path = sys.argv[1]
model, tokenizer = load_causal_lm(path, dtype=torch.float32), load_tokenizer(path)
torch.manual_seed(7)
random.seed(7)
config = default_config().actor_rollout_ref.rollout.vllm
rollout = VllmRollout(model, tokenizer, engine_config=config)
after_start = {key: os.environ.get(key) for key in LOADER}
threads = torch.get_num_threads()
torch.set_num_threads(1)  # vLLM's CPU worker replaces this function with a no-op
threads_settable = torch.get_num_threads() == 1
print(json.dumps({
    "before": before,
    "after_check": after_check,
    "after_start": after_start,
    "threads": threads,
    "threads_settable": threads_settable,
    "torch_draw": torch.rand(3).tolist(),
    "python_draw": random.random(),
}))
"""


def test_starting_vllm_keeps_threads_random_streams_and_loader_variables():
    path = tiny_head32_path("tiny-llama")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, path], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state["after_check"] == state["before"]
    assert state["after_start"] == state["before"]  # vLLM sets LD_PRELOAD to torch's libgomp when it starts
    assert state["threads"] == 2 and state["threads_settable"]

    import random

    import torch

    generator = torch.Generator().manual_seed(7)
    assert state["torch_draw"] == torch.rand(3, generator=generator).tolist()
    assert state["python_draw"] == random.Random(7).random()
