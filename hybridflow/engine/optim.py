"""AdamW with a warm-up then constant or cosine learning rate, its settings (``OptimConfig``), and a
model under training together with both (``TrainedModel``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.validation import require, require_choice, require_positive


def _constant(progress: float, min_lr_ratio: float) -> float:
    return 1.0


def _cosine(progress: float, min_lr_ratio: float) -> float:
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# lr_scheduler name -> the factor on the peak lr after warm-up, given the fraction of the decay done
SCHEDULES: dict[str, Callable[[float, float], float]] = {"constant": _constant, "cosine": _cosine}

FUSED_DEVICES = ("cpu", "cuda")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float  # peak learning rate of AdamW
    weight_decay: float  # AdamW decoupled weight decay
    betas: list[float]  # AdamW betas
    eps: float  # AdamW epsilon
    lr_warmup_steps: int  # linear warm-up steps from 0 to lr
    lr_scheduler: str  # after warm-up: constant | cosine (engine.optim.SCHEDULES)
    min_lr_ratio: float  # cosine decays to lr * min_lr_ratio at the last step

    def __post_init__(self) -> None:
        require(self.lr >= 0, "lr", f"must be >= 0, got {self.lr}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            f"need two in [0, 1), got {self.betas}",
        )
        require_positive(self.eps, "eps")
        require(self.lr_warmup_steps >= 0, "lr_warmup_steps", f"must be >= 0, got {self.lr_warmup_steps}")
        require_choice(self.lr_scheduler, SCHEDULES, "lr_scheduler")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW; the fused kernel where torch has one (bench/train_kernels.py, 135 M parameters on 2 CPU
    cores: 40 ms vs 134 ms per step)."""
    params = [p for p in model.parameters() if p.requires_grad]  # a frozen base (LoRA) has no optimizer state
    fused = bool(params) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    optimizer = torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=tuple(config.betas),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )
    init_adamw_state(optimizer)
    return optimizer


def init_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Give every parameter the state AdamW would create at its first step (step 0, both moments zero), now.

    torch creates it lazily, in the first update's optimizer step, in the memory the update's activations had
    just freed; the second update's activations then land on fresh pages (on 2 CPU cores: 236,000 page faults, 1.6 s
    more than a later update of SmolLM2-135M, docs/log/training.md §42). Made before any update, the state stays
    below the activations, which every update after the first reuses. The values are torch's: a step from here
    equals a step from lazily made state (tests/engine/test_optim.py)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            if group["capturable"] or group["fused"]:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            else:
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")
            for key in ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if group["amsgrad"] else ())):
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)


def lr_multiplier(step: int, config: OptimConfig, total_steps: int) -> float:
    """The factor on the peak lr at optimizer step ``step`` (0-based)."""
    if step < config.lr_warmup_steps:
        return (step + 1) / config.lr_warmup_steps
    decay_steps = max(1, total_steps - config.lr_warmup_steps)
    progress = min(1.0, (step - config.lr_warmup_steps) / decay_steps)
    return SCHEDULES[config.lr_scheduler](progress, config.min_lr_ratio)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config, total_steps))


@dataclass(frozen=True)
class TrainedModel:
    """A model under training with its optimizer and learning-rate schedule, which go everywhere together:
    the update (engine/update.py), checkpoints (engine/checkpoint.py), the hybrid engine's offload. Roles
    that only score (reference, reward model) hold a plain module instead."""

    model: nn.Module  # sharded (FSDP2) in workers; a plain module in tests
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # stepped once per training step

    @classmethod
    def build(cls, model: nn.Module, config: OptimConfig, total_steps: int) -> TrainedModel:
        """``model`` with AdamW and the learning-rate schedule of ``config`` over ``total_steps`` steps."""
        optimizer = build_optimizer(model, config)
        return cls(model, optimizer, build_lr_scheduler(optimizer, config, total_steps))
