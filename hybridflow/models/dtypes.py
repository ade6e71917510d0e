"""Dtype names as configs spell them (``bf16``, ``fp32``, ``auto``, ...).

``auto`` is the fastest dtype the device multiplies in: bf16 where the hardware has bf16 matmul
units (CUDA with bf16 support; CPUs with AVX512-BF16 or AMX), fp32 elsewhere. On a CPU without
them (e.g. AVX2-only AMD EPYC Milan) bf16 matmuls are converted element by element and measured
6-8x slower than fp32 (1024x1024 weight, 64-512 rows: 20 vs 123-165 GFLOP/s on 2 cores), so bf16
there costs speed and buys nothing. The rule is a fixed property of the machine, not a timing,
so the same config on the same machine always resolves to the same dtype.
"""

from __future__ import annotations

from functools import cache

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_CHOICES = {**DTYPES, "auto": None}  # what a config may name
CPU = torch.device("cpu")


@cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def fast_dtype(device: torch.device) -> torch.dtype:
    """bf16 where ``device`` has bf16 matmul hardware, else fp32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32


def parse_dtype(name: str, device: torch.device = CPU) -> torch.dtype:
    """The dtype a config names; ``auto`` resolves for ``device`` (see the module docstring)."""
    if name not in DTYPE_CHOICES:
        raise ValueError(f"unknown dtype '{name}'; use one of {sorted(DTYPE_CHOICES)}")
    return fast_dtype(device) if name == "auto" else DTYPES[name]
