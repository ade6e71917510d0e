"""Decode's layers with the work between the matmuls fused: three C++ calls a layer instead of about forty torch ops.

model.py's ragged decode runs each layer as RMSNorm, the qkv product, rotary on q and k, the key/value store, the
ragged attention kernel's two passes around a softmax, the output product, the residual add, RMSNorm again, the
gate/up product, SiLU(gate) * up, the down product and the residual add: at 64 sequences most of those ops take
10-50 us each, and Python and torch's dispatch between them about as much again. Here the layer is

    the qkv product -> rope_store_attend -> the output product -> add_rms_norm -> the gate/up product -> silu_mul
    -> the down product -> add_rms_norm (with the next layer's input norm)

with the fused ops of kernels/csrc/fused_decode.cpp (built into kernels/build.py's module), which compute bit for bit
what the torch ops compute (tests/rollout/native/test_fused_layers.py compares them with torch.equal). Dense layers
only: a family with q/k norms, clipped q/k/v or experts runs model.py's loop. Prefill and the padded extend use the
last two ops too (``output_and_mlp``, from model.py's `_output_and_mlp`), where ``fits``.
"""

from __future__ import annotations

import torch

from hybridflow.rollout.native import ragged_attention
from hybridflow.rollout.native.kv_cache import KVCache
from hybridflow.rollout.native.weights import LayerWeights, Weights

_DTYPES = (torch.bfloat16, torch.float32)


def fits(weights: Weights) -> bool:
    """Whether the fused ops can run these weights' layers: dense, no q/k norms or clipping, CPU, bf16 or fp32, and
    the C++ module built (ragged_attention.available)."""
    embed = weights.embed
    if embed.device.type != "cpu" or embed.dtype not in _DTYPES or weights.spec.clip_qkv is not None:
        return False
    if any(layer.experts is not None or layer.q_norm is not None for layer in weights.layers):
        return False
    return ragged_attention.available()


def decode_layers(
    weights: Weights,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    cache: KVCache,
    x: torch.Tensor,
    normed: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """The residual stream after every layer, (B, H): model.py's ragged decode loop, from x (B, H) entering the
    first layer and ``normed``, its input norm of x. positions, slots and lengths (B,) int64 as model.py computes
    them; width = max(lengths)."""
    ops, eps, heads = ragged_attention.module(), weights.spec.rms_norm_eps, weights.spec.num_heads
    layers = weights.layers
    for i, layer in enumerate(layers):
        qkv = layer.qkv(normed)
        attn = ops.rope_store_attend(
            qkv, rope_cos, rope_sin, positions, cache.k[i], cache.v[i], slots, lengths, width, scale, heads
        )
        x, normed = ops.add_rms_norm(x, weights.tp.all_reduce(layer.o(attn)), layer.post_norm, eps)
        down = weights.tp.all_reduce(layer.down(ops.silu_mul(layer.gate_up(normed))))
        if i + 1 < len(layers):
            x, normed = ops.add_rms_norm(x, down, layers[i + 1].input_norm, eps)
        else:
            x = x + down
    return x


def output_and_mlp(weights: Weights, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """model.py's `_output_and_mlp` for a dense layer, (..., H): the residual add with the post-attention norm, and
    SiLU x up, fused (any rows: prefill's and the padded extend's (Bp, T, H))."""
    ops, shape = ragged_attention.module(), x.shape
    output = weights.tp.all_reduce(layer.o(attn)).reshape(-1, shape[-1])
    x, normed = ops.add_rms_norm(x.reshape(-1, shape[-1]), output, layer.post_norm, weights.spec.rms_norm_eps)
    return (x + weights.tp.all_reduce(layer.down(ops.silu_mul(layer.gate_up(normed))))).view(shape)
