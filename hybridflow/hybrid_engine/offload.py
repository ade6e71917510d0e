"""Moving the training state off the accelerator while the same devices generate, and back.

FSDP2 parameters are DTensors; ``module.to`` moves their local shards (and gradients), and
optimizer states move tensor by tensor. Each function returns the bytes it moved, so that a
no-op (the state is already on ``device``, as on a CPU-only machine) reports 0.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes_off(tensors, device: torch.device) -> int:
    """Bytes of this rank's part of the tensors that are not on ``device`` yet."""
    return sum(_local(t).numel() * t.element_size() for t in tensors if t is not None and _local(t).device != device)


def move_model(model: nn.Module, device: torch.device | str) -> int:
    """This rank's parameter shards and their gradients to ``device``."""
    device = torch.device(device)
    params = list(model.parameters())
    moved = _bytes_off(params, device) + _bytes_off([p.grad for p in params], device)
    if moved:
        model.to(device)
    return moved


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Every tensor of the optimizer's per-parameter state (moments, step counts) to ``device``."""
    device = torch.device(device)
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and _bytes_off([value], device):
                moved += _bytes_off([value], device)
                state[key] = value.to(device, non_blocking=True)
    if moved and device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies off the GPU must have landed before the host reads them
    return moved
