"""What other libraries print, kept off a run's console and logs unless asked for (``--debug`` or
``HYBRIDFLOW_DEBUG=1``).

transformers draws a progress bar whenever it loads or saves a model ("Loading weights", "Writing model
shards"), vLLM logs its engine's settings and advice at start, torch's C++ side and Ray announce themselves.
In a run those lines come once per worker process, bury hybridflow's own progress display and can land in
front of a command's one-line error. So a command quiets them in its own process (``command_output``), and
every worker process starts with the same settings (``quiet_env``, given to Ray by controller/ray_runtime.py)
and applies them as it starts (``quiet_this_process``, by the worker host); with ``--debug`` they speak
again. Each setting is the library's own switch; a value the user already set in the environment wins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

# each library's own switch, read when it is imported (and by every process started with this environment)
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",  # transformers' logger: loading reports and advice
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub's bars, and transformers' (which follow them)
    "TQDM_DISABLE": "1",  # any other library's tqdm bar (tqdm reads TQDM_* as its defaults)
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's engine settings and tuning advice at start
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # torch's C++ warnings (vLLM's NUMA binding notice on CPU)
    # the one deprecation warning vLLM's CPU start sets off in torch, once per worker (a new process reads it)
    "PYTHONWARNINGS": "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
}

_verbose = False  # the running command's --debug


def verbose() -> bool:
    """Whether libraries may speak: the running command has ``--debug``, or ``HYBRIDFLOW_DEBUG`` is set."""
    return _verbose or os.environ.get("HYBRIDFLOW_DEBUG", "") not in ("", "0")


def quiet_env() -> dict[str, str]:
    """The environment of a new process (a worker): libraries quiet, values already in this process's environment
    winning; with ``--debug``, ``HYBRIDFLOW_DEBUG=1`` instead, so that they speak there too."""
    if verbose():
        return {"HYBRIDFLOW_DEBUG": "1"}
    return {key: os.environ.get(key, value) for key, value in QUIET_ENV.items()}


def quiet_this_process() -> None:
    """Quiet the libraries of this process: the environment for those imported later (and for processes it
    starts), each library's own switch for those already imported."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    # vLLM warns while it imports, before it configures its logger from VLLM_LOGGING_LEVEL ("Triton is installed,
    # but doesn't include CPU backend"): a level set first keeps those off too
    logging.getLogger("vllm").setLevel(logging.ERROR)


@contextlib.contextmanager
def command_output(debug: bool) -> Iterator[None]:
    """For a command's duration: libraries quiet in this process unless ``debug``, and ``verbose()`` telling the
    worker processes it starts the same."""
    global _verbose
    saved, _verbose = _verbose, debug
    if not verbose():
        quiet_this_process()
    try:
        yield
    finally:
        _verbose = saved


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and logger off for a block, whatever the process's settings (a model
    conversion says what it does in one line of its own), then as they were."""
    from transformers.utils import logging as transformers_logging

    bars, level = transformers_logging.is_progress_bar_enabled(), transformers_logging.get_verbosity()
    if not verbose():
        transformers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)
        if bars:
            transformers_logging.enable_progress_bar()
