"""Decode attention that reads each sequence's real length of the KV cache, not its whole preallocated row.

In multi-turn rollout a slot is allocated for the longest conversation the turn budget allows, while the
conversations decoding at any moment are much shorter; torch's batched matmuls over whole rows read
(and multiply) every preallocated position, and over a slice of the rows they copy it first
(docs/results.md). A small C++ kernel (csrc/ragged_decode.cpp, compiled on first use with
torch's extension builder, then cached) reads keys and values in place, position 0..length-1 of each
slot, and sums products in float32. In float32 and bfloat16 one call runs both passes and, between them, the
softmax torch's kernel computes (the same numbers: scores and probabilities rounded to the dtype, as the whole-row
path's batched matmuls round them), each (sequence, kv head) on one thread, with its values fetched while its
scores are computed; other dtypes run the passes apart with torch's softmax between them.

The build needs a C++ compiler; where there is none (or it fails), ``available()`` is False with the
reason in ``unavailable_reason()``, and the engine attends over whole rows as before.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

SOURCES = [
    Path(__file__).parent / "csrc" / name for name in ("ragged_decode.cpp", "ragged_attend.cpp", "fused_decode.cpp")
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

    # fused_decode.cpp uses ATen's vector types as torch's own kernels on this CPU do (its exponential among them)
    capability = torch.backends.cpu.get_cpu_capability()
    # -ffp-contract=off: no product and sum fused into one rounding where torch's ops round twice
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
    if capability in ("AVX2", "AVX512"):
        flags += [f"-DCPU_CAPABILITY_{capability}", f"-DCPU_CAPABILITY={capability}"]
    else:
        flags += ["-DCPU_CAPABILITY=DEFAULT"]
    return load(
        name=f"hybridflow_ragged_decode_{_cpu_tag()}",
        sources=[str(source) for source in SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call: about 25 s on 2 cores)."""
    global _module, _failure
    if _module is None and _failure is None:
        try:
            _module = _build()
        except Exception as error:  # no compiler, no ninja, a build error: attend over whole rows instead
            _failure = f"{type(error).__name__}: {error}".splitlines()[0]
            logger.warning("ragged decode attention unavailable (%s); attending over whole cache rows", _failure)
    return _module is not None


def module() -> ModuleType:
    """The built module (the ragged kernel's passes and fused_layers.py's ops); RuntimeError where it could not be
    built."""
    if not available():
        raise RuntimeError(f"the ragged decode kernel is unavailable: {_failure}")
    return _module


def unavailable_reason() -> str | None:
    """Why the kernel could not be built (None when it is available or not tried yet)."""
    return _failure


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """softmax(scale * q.k) v over positions 0..lengths[b]-1 of cache slot slots[b] (default: slot b).

    q (B, Hkv, G, D); keys/values one cache layer (S, Hkv, T, D); lengths (B,) int64 in 1..T; slots (B,)
    int64 in 0..S-1, several queries may read one slot (the tokens of one sequence in an extend); width:
    max(lengths) (a step's layers share it: give it once). Returns (B, Hkv, G, D) in q's dtype.
    """
    if not available():
        raise RuntimeError(f"the ragged decode kernel is unavailable: {_failure}")
    if slots is None:
        slots = torch.arange(q.shape[0], device=q.device)
    if width is None:
        width = int(lengths.max())
    if q.dtype in (torch.float32, torch.bfloat16):  # the same numbers as below, in one call (no scores tensor)
        return _module.attend(q.contiguous(), keys, values, lengths, slots, width, scale)
    scores = _module.scores(q.contiguous(), keys, lengths, slots, width, scale)  # (B, Hkv, G, width) float32
    # scores and probabilities rounded to q's dtype, as the batched matmuls over whole rows round them (bf16): the
    # two paths then differ by the order of the float32 sums alone, and generation by which one ran hardly at all
    probs = torch.softmax(scores.to(q.dtype), dim=-1).float()
    return _module.values(probs, values, lengths, slots)
