"""A transformers model's RMSNorms and SiLU MLPs run through the fused CPU kernels (kernels/elementwise.py).

transformers' RMSNorm is about 8 torch ops forward and 15 backward, most of them passes over float32 copies of the
activations: on 2 cores, 1.6 ms forward and backward at SmolLM2-135M's width and 847 tokens, 61 of them in a pass of
1.3 s. ``fuse_elementwise`` gives each such module a forward that calls the fused function instead (0.8 ms; the pass
0.94x: bench/train_kernels.py, docs/log/training.md §42), where its inputs fit (plain CPU tensors, float32 or
bfloat16, the C++ module built), and transformers' own forward otherwise (a DTensor under tensor parallelism, a GPU,
another dtype). SiLU x up, bound by its exponential, gains memory (SiLU(gate) is not kept), not time. The numbers are
the same bit for bit, forward and backward (tests/engine/test_fused_modules.py), so nothing about a run changes but
its speed.

Which modules: those whose class's ``forward`` is, line for line, transformers' Llama RMSNorm or Llama MLP (with
SiLU as its activation): Llama, Mistral, Qwen2 and Qwen3's, and the dense MLPs of the MoE families. A family that
computes its norm otherwise (Gemma's 1 + weight) keeps its own.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import types

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from hybridflow.kernels import elementwise


def _body(cls: type) -> str:
    """The source of ``cls.forward`` without its class's name (families copy Llama's code under their own names)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return ""
    return source.replace(cls.__name__, "_")


@functools.cache
def _kind(cls: type) -> str | None:
    """'norm' or 'mlp' where the class computes what Llama's RMSNorm or MLP computes, else None."""
    body = _body(cls)
    if body and body == _body(LlamaRMSNorm):
        return "norm"
    if body and body == _body(LlamaMLP):
        return "mlp"
    return None


def _norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if elementwise.fits(hidden_states, module.weight):
        return elementwise.rms_norm(hidden_states, module.weight, module.variance_epsilon)
    return type(module).forward(module, hidden_states)


def _mlp_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = module.gate_proj(x), module.up_proj(x)
    if elementwise.fits(gate, up):
        return module.down_proj(elementwise.silu_mul(gate, up))
    return module.down_proj(module.act_fn(gate) * up)


def fuse_elementwise(model: nn.Module) -> int:
    """Give the model's Llama-style RMSNorms and SiLU MLPs the fused forwards; returns how many modules got one.
    Idempotent. Where the C++ module cannot be built, the modules keep running transformers' ops (logged once by
    kernels/build.py)."""
    fused = 0
    for module in model.modules():
        kind = _kind(type(module))
        if kind == "mlp" and not isinstance(module.act_fn, (SiLUActivation, nn.SiLU)):
            kind = None
        if kind is not None:
            module.forward = types.MethodType(_norm_forward if kind == "norm" else _mlp_forward, module)
            fused += 1
    return fused
