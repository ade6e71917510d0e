"""A transformers model's RMSNorms and SiLU MLPs run through the fused CPU kernels (kernels/elementwise.py).

transformers' RMSNorm is about 8 torch ops forward and 15 backward, most of them passes over float32 copies of the
activations: on 2 cores, 1.6 ms forward and backward at SmolLM2-135M's width and 847 tokens, 61 of them in a pass of
1.3 s. ``fuse_elementwise`` gives each such module a forward that calls the fused function instead (0.8 ms; the pass
0.94x: bench/train_kernels.py, docs/log/training.md §42), where its inputs fit (plain CPU tensors, float32 or
bfloat16, the C++ module built), and transformers' own forward otherwise (a DTensor under tensor parallelism, a GPU,
another dtype). SiLU x up, bound by its exponential, gains memory (SiLU(gate) is not kept), not time. The rotary
embedding of q and k (transformers' ``apply_rotary_pos_emb``: 1.45 ms forward and backward a layer at 847 tokens,
0.71 ms fused) is a function the attention modules call by its name in their family's modeling module, so that name
is what gets the fused version: in the whole process, for every model of the family (the numbers are the same, so a
model that was not given the fused forwards computes what it computed before, only faster on CPU). The numbers are
the same bit for bit, forward and backward (tests/engine/test_fused_modules.py), so nothing about a run changes but
its speed.

Which modules: those whose class's ``forward`` is, line for line, transformers' Llama RMSNorm or Llama MLP (with
SiLU as its activation): Llama, Mistral, Qwen2 and Qwen3's, and the dense MLPs of the MoE families. A family that
computes its norm otherwise (Gemma's 1 + weight) keeps its own. The rotary embedding likewise: a modeling module whose
``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's, line for line.
"""

from __future__ import annotations

import functools
import inspect
import sys
import textwrap
import types

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama
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


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the fused rotary takes these: q, k (B, H, T, D) contiguous along D, cos and sin (B, T, D) contiguous
    without gradients, plain CPU tensors of one float dtype (``elementwise.fits``)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or q.shape[-1] % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    rows = (q.shape[0], q.shape[2], q.shape[3])
    if cos.shape != rows or sin.shape != rows or (k.shape[0], k.shape[2], k.shape[3]) != rows:
        return False
    if cos.requires_grad or sin.requires_grad or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    return elementwise.fits(q, k, cos, sin)


def _fused_rotary(original):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, through the fused kernel where the
    inputs fit, ``original`` otherwise."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and _rotary_fits(q, k, cos, sin):
            return elementwise.rotary(q, cos, sin), elementwise.rotary(k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.unfused = original
    return apply_rotary_pos_emb


def _fuse_rotary(namespace: types.ModuleType) -> None:
    """Give a modeling module's ``apply_rotary_pos_emb`` the fused version (once) if it and its ``rotate_half`` are
    Llama's."""
    current = getattr(namespace, "apply_rotary_pos_emb", None)
    if current is None or hasattr(current, "unfused"):
        return
    llama = getattr(modeling_llama.apply_rotary_pos_emb, "unfused", modeling_llama.apply_rotary_pos_emb)
    rotate_half = getattr(namespace, "rotate_half", None)
    if _source(current) == _source(llama) and _source(rotate_half) == _source(modeling_llama.rotate_half):
        namespace.apply_rotary_pos_emb = _fused_rotary(current)


def fuse_elementwise(model: nn.Module) -> int:
    """Give the model's Llama-style RMSNorms and SiLU MLPs the fused forwards, and its family's rotary embedding the
    fused function; returns how many modules got a fused forward. Idempotent. Where the C++ module cannot be built,
    the modules keep running transformers' ops (logged once by kernels/build.py)."""
    fused = 0
    for namespace in {sys.modules.get(type(module).__module__) for module in model.modules()} - {None}:
        _fuse_rotary(namespace)
    for module in model.modules():
        kind = _kind(type(module))
        if kind == "mlp" and not isinstance(module.act_fn, (SiLUActivation, nn.SiLU)):
            kind = None
        if kind is not None:
            module.forward = types.MethodType(_norm_forward if kind == "norm" else _mlp_forward, module)
            fused += 1
    return fused
