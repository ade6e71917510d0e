"""The C++ module of csrc/, compiled on first use with torch's extension builder, then cached (about 25 s on 2 cores,
once per machine and CPU kind).

The build needs a C++ compiler; where there is none (or it fails), ``available()`` is False with the reason in
``unavailable_reason()`` (logged once), and callers run torch's ops instead.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "ragged_decode.cpp",
        "ragged_attend.cpp",
        "fused_decode.cpp",
        "train_elementwise.cpp",
        "train_softmax.cpp",
        "train_rotary.cpp",
        "packed_rows.cpp",
        "sampling.cpp",
    )
]
logger = logging.getLogger(__name__)

_module: ModuleType | None = None
_failure: str | None = None


def _cpu_tag() -> str:
    """A short tag of this CPU's instruction-set flags: a build with -march=native is only loaded on its kind."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    # the fused ops use ATen's vector types as torch's own kernels on this CPU do (its exponential among them)
    capability = torch.backends.cpu.get_cpu_capability()
    # -ffp-contract=off: no product and sum fused into one rounding where torch's ops round twice
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
    if capability in ("AVX2", "AVX512"):
        flags += [f"-DCPU_CAPABILITY_{capability}", f"-DCPU_CAPABILITY={capability}"]
    else:
        flags += ["-DCPU_CAPABILITY=DEFAULT"]
    return load(
        name=f"hybridflow_cpu_kernels_{_cpu_tag()}",
        sources=[str(source) for source in SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def available() -> bool:
    """Whether the module is built and loaded (building it on the first call)."""
    global _module, _failure
    if _module is None and _failure is None:
        try:
            _module = _build()
        except Exception as error:  # no compiler, no ninja, a build error: the callers run torch's ops
            _failure = f"{type(error).__name__}: {error}".splitlines()[0]
            logger.warning("the C++ CPU kernels are unavailable (%s); running torch's ops instead", _failure)
    return _module is not None


def module() -> ModuleType:
    """The built module; RuntimeError where it could not be built."""
    if not available():
        raise RuntimeError(f"the C++ CPU kernels are unavailable: {_failure}")
    return _module


def unavailable_reason() -> str | None:
    """Why the module could not be built (None when it is available or not tried yet)."""
    return _failure
