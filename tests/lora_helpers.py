"""LoRA models for the tests: peft's adapters on a model, moved off their start so that they matter (peft starts
B at zero, where the adapted model is the base)."""

from __future__ import annotations

import torch

from hybridflow.engine.lora import LoraConfig, apply_lora

ALL = ["all-linear"]


def randomise_adapters(model: torch.nn.Module, seed: int = 0, scale: float = 0.1, parts: str = ".lora_") -> None:
    """Seeded noise of ``scale`` into every adapter parameter whose name holds ``parts`` (".lora_B.": B only)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parts in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]  # a mixture's expert weights (peft's target_parameters)


def lora_model(
    model: torch.nn.Module,
    *,
    seed: int = 0,
    rank: int = 4,
    alpha: float = 8.0,
    targets: list[str] = ALL,
    parameters: list[str] | None = None,
) -> torch.nn.Module:
    """``model`` (wrapped in place) with adapters of ``rank`` on ``targets`` (and on the expert weights
    ``parameters``), randomised with ``seed``."""
    settings = LoraConfig(
        rank=rank, alpha=alpha, dropout=0.0, target_modules=list(targets), target_parameters=list(parameters or [])
    )
    adapted = apply_lora(model, settings)
    randomise_adapters(adapted, seed)
    return adapted
