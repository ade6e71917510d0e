"""The switches that keep other libraries quiet: what a worker process starts with, with and without --debug, and
that each switch does what it is there for in a new process."""

import subprocess
import sys

from hybridflow.controller.ray_runtime import worker_env_vars
from hybridflow.library_output import QUIET_ENV, command_output, quiet_env


def clean_env(monkeypatch) -> None:
    for key in ("HYBRIDFLOW_DEBUG", *QUIET_ENV):
        monkeypatch.delenv(key, raising=False)


def test_workers_start_quiet_unless_debug(monkeypatch):
    clean_env(monkeypatch)
    assert quiet_env() == QUIET_ENV
    assert QUIET_ENV.items() <= worker_env_vars().items()
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's own setting wins
    assert quiet_env()["TRANSFORMERS_VERBOSITY"] == "info"
    with command_output(debug=True):  # a command's --debug reaches its workers
        assert quiet_env() == {"HYBRIDFLOW_DEBUG": "1"}
        assert "VLLM_LOGGING_LEVEL" not in worker_env_vars()
    assert quiet_env()["VLLM_LOGGING_LEVEL"] == "ERROR"  # after the command, as before it
    monkeypatch.setenv("HYBRIDFLOW_DEBUG", "1")
    assert quiet_env() == {"HYBRIDFLOW_DEBUG": "1"}


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_each_switch_silences_its_library_in_a_new_process():
    """The new process reads the switches as a worker does: transformers' bars and logger, tqdm, the warning
    filter (a malformed PYTHONWARNINGS entry would be ignored with a message of its own)."""
    code = """
import logging, warnings
import tqdm
from transformers.utils import logging as tl
message = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"
warnings.warn(message, FutureWarning)
for _ in tqdm.tqdm(range(3), desc="a bar"):
    pass
for _ in tl.tqdm(range(3), desc="transformers' bar"):
    pass
tl.get_logger("transformers.modeling_utils").warning("a loading report")
"""
    loud = run(code, {"PATH": "/usr/bin:/bin"})
    for line in ("reduce_op", "a bar", "transformers' bar", "a loading report"):
        assert line in loud.stderr, loud.stderr
    quiet = run(code, {"PATH": "/usr/bin:/bin", **QUIET_ENV})
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
