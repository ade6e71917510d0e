"""Dtype names as configs spell them (``bf16``, ``fp32``, ...)."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; use one of {sorted(DTYPES)}")
    return DTYPES[name]
