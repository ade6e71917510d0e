"""Model FLOPs of the training passes, and model FLOPs utilisation (MFU) against a measured peak.

FLOPs are counted on real tokens only, so padding that a pass computes anyway shows up as a lower
MFU. A decoder's forward costs, per sequence of L tokens,

    2 * W * L                  every weight of every linear layer (lm_head / value head included)
  + 2 * layers * H * d * L^2   causal attention: QK^T and AV, each 2 * d FLOPs per (query, key) pair
                               over the L^2 / 2 pairs of the causal triangle, per head

where a pass that runs the LM head on some positions only (the response tokens, see forward.py)
counts the head's weights for those positions alone; backward is twice the forward, so a
training step is 3x forward (activation recomputation from gradient checkpointing is not counted: these
are model FLOPs, not hardware FLOPs). A rank of a tensor-parallel group counts its share: 1/t of the
decoder's layers and heads, and the whole (replicated) LM head (``ModelFlops.per_rank``).

The peak is measured, not looked up: large matmuls in the device's fast dtype (bf16 where it has
bf16 units, else fp32; models/dtypes.py) for about half a second, once per process and device
(``peak_flops``). On a CPU that is the matmul rate of the cores this process gets (idle, 2 cores:
about 0.8 TFLOP/s bf16 on an AMD EPYC with AVX512-BF16, about 0.17 TFLOP/s fp32 on an AVX2-only
EPYC Milan); other processes busy on the same cores at start-up lower it, and MFU then reads high.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from hybridflow.batch_keys import ATTENTION_MASK, RESPONSES
from hybridflow.engine.tensor_parallel import tensor_parallel_size
from hybridflow.lengths import packed_lengths, row_lengths
from hybridflow.models.dtypes import fast_dtype
from hybridflow.protocol import DataProto

PassWork = tuple[Sequence[int], "int | None"]  # tokens computed per row, positions the LM head ran on (None: all)


@dataclass(frozen=True)
class ModelFlops:
    linear_weights: int  # W: weights of all nn.Linear layers
    attention_width: int  # layers * heads * head_dim
    head_weights: int = 0  # of which the LM head's (output embeddings)

    def forward(self, lengths: Sequence[int], head_tokens: int | None = None) -> float:
        """Forward FLOPs of sequences of these real-token lengths; the LM head on ``head_tokens``
        positions (None: on every token)."""
        tokens = sum(lengths)
        head_tokens = tokens if head_tokens is None else head_tokens
        squares = sum(length * length for length in lengths)
        linear = (self.linear_weights - self.head_weights) * tokens + self.head_weights * head_tokens
        return 2.0 * linear + 2.0 * self.attention_width * squares

    def training(self, lengths: Sequence[int], head_tokens: int | None = None) -> float:
        """Forward plus backward."""
        return 3.0 * self.forward(lengths, head_tokens)

    def per_rank(self, tp: int) -> ModelFlops:
        """What one of ``tp`` tensor-parallel ranks computes of the same rows: 1/tp of the decoder's
        linear layers and attention heads, and the whole LM head (replicated, engine/tensor_parallel)."""
        decoder = self.linear_weights - self.head_weights
        return ModelFlops(decoder // tp + self.head_weights, self.attention_width // tp, self.head_weights)


def model_flops(model: nn.Module) -> ModelFlops:
    """FLOP counts of a Hugging Face decoder (sharded or not: DTensor sizes are the global ones)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    weights = sum(module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weights = head.weight.numel() if isinstance(head, nn.Linear) else 0
    return ModelFlops(weights, config.num_hidden_layers * heads * head_dim, head_weights)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CPU = torch.device("cpu")


@cache
def peak_flops(device: torch.device = CPU, dtype: torch.dtype | None = None, seconds: float = 0.5) -> float:
    """Measured FLOP/s of square ``dtype`` matmuls on ``device`` (default its fast dtype); once per
    process (cached).

    The best of several short windows, so that a moment of contention (other processes on the
    same CPU cores) lowers the estimate less.
    """
    dtype = dtype or fast_dtype(device)
    size = 2048 if device.type == "cpu" else 8192
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # warm-up: kernels, thread pool
    _synchronize(device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        done, start = 0, time.perf_counter()
        while done == 0 or time.perf_counter() - start < seconds / 5:
            torch.mm(a, b)
            done += 1
            _synchronize(device)
        best = max(best, 2.0 * size**3 * done / (time.perf_counter() - start))
    return best


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def flops_metrics(name: str, flops: float, seconds: float, peak: float) -> dict[str, float]:
    """``perf/tflops_<name>`` (achieved TFLOP/s) and ``perf/mfu_<name>`` (achieved / peak)."""
    achieved = flops / max(seconds, 1e-9)
    return {f"perf/tflops_{name}": achieved / 1e12, f"perf/mfu_{name}": achieved / peak}


class PassMeter:
    """Times one role's passes and reports their FLOP/s against the peak measured at start-up."""

    def __init__(self, model: nn.Module, sequence_parallel: int = 1):
        self.flops = model_flops(model).per_rank(tensor_parallel_size(model))
        self.sequence_parallel = sequence_parallel  # ranks that split each pass's tokens (and attention heads)
        self.peak = peak_flops(model_device(model))

    def metrics(self, name: str, work: PassWork, seconds: float, training: bool, repeats: int = 1) -> dict[str, float]:
        """Metrics of a pass over ``work`` (``repeats`` times, e.g. epochs)."""
        lengths, head_tokens = work
        flops = (
            repeats
            * (self.flops.training(lengths, head_tokens) if training else self.flops.forward(lengths, head_tokens))
            / self.sequence_parallel
        )
        return {**flops_metrics(name, flops, seconds, self.peak), "perf/peak_tflops": self.peak / 1e12}


def pass_work(data: DataProto, remove_padding: bool) -> tuple[list[int], int | None]:
    """What a pass computes, for its FLOP count: tokens per row (real tokens; a prompt shared by
    packed rows once, as micro-batches keep its rows together; one that a micro-batch size or token
    budget splits is computed more than once, and MFU reads a little low) and the number of
    positions the LM head runs on (packed: the real response tokens; padded: None, every token)."""
    if not remove_padding:
        return row_lengths(data), None
    response_length = data.batch[RESPONSES].shape[1]
    return packed_lengths(data), int(data.batch[ATTENTION_MASK][:, -response_length:].sum())
