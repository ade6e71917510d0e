"""Dtype names from configs, and what ``auto`` resolves to on this machine."""

from pathlib import Path

import pytest
import torch

from hybridflow.models import parse_dtype
from hybridflow.rollout.native.linear import Matrix


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU flags from /proc/cpuinfo (Linux)")
def test_auto_is_bf16_exactly_where_the_cpu_has_bf16_matmul_units():
    flags = cpu_flags()
    expected = torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32
    assert parse_dtype("auto", torch.device("cpu")) == expected


def test_named_dtypes_and_a_clear_error_for_unknown_ones():
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("fp32") == torch.float32
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; use one of \['auto', 'bf16', 'fp16', 'fp32'\]"):
        parse_dtype("int8")


def test_a_bf16_matrix_multiplies_like_f_linear_whether_or_not_this_cpu_packs_bf16():
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32).bfloat16(), torch.randn(48).bfloat16()
    x = torch.randn(5, 32).bfloat16()
    matrix = Matrix(weight, bias)
    matrix.repack()  # packs where oneDNN can (AVX512 / AVX-NE-CONVERT), a no-op elsewhere
    assert torch.equal(matrix(x), torch.nn.functional.linear(x, weight, bias))
