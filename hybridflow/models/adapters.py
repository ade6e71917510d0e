"""How LoRA adapters travel from the trainer to a rollout engine: under the plain model's layer name,
``<layer>.lora_A`` (rank x in_features) and ``<layer>.lora_B`` (out_features x rank), the adapted layer's
weight standing for W + scaling · B A. The trainer (engine/lora.py) names them; a rollout (rollout/) reads
the names back.

A mixture's experts are one 3-D parameter per projection, ``<...>.mlp.experts.gate_up_proj`` of shape
(E, out, in), adapted through peft's ``target_parameters``: its adapters travel under the parameter's own name
(``<...>.experts.gate_up_proj.lora_A``) in peft's layout, A (E·r, in) and B (out, r·E), which ``expert_factors``
reads as each expert's own (A_e, B_e).
"""

from __future__ import annotations

from collections.abc import Container

import torch

LORA_A = "lora_A"
LORA_B = "lora_B"
ATTN, MLP, UNEMBED = "attn", "mlp", "unembed"  # the parts of a model an adapter may adapt


def adapter_name(layer: str, part: str) -> str:
    """The name that adapter ``part`` (LORA_A or LORA_B) of ``layer`` (model.layers.0.self_attn.q_proj) travels by."""
    return f"{layer}.{part}"


def adapted_layer(weight: str) -> str:
    """The name an adapted weight's adapters travel under: a linear layer's (its weight's name without
    ``.weight``), or an expert parameter's own."""
    return weight.removesuffix(".weight")


def adapted_weight(layer: str, weights: Container[str]) -> str:
    """The weight among ``weights`` (names) that the adapters travelling under ``layer`` adapt."""
    return layer if layer in weights else f"{layer}.weight"


def split_adapter_name(name: str) -> tuple[str, str]:
    """(layer, LORA_A or LORA_B) of an adapter's name; ValueError for any other name."""
    layer, _, part = name.rpartition(".")
    if part not in (LORA_A, LORA_B) or not layer:
        raise ValueError(f"{name!r} names no LoRA adapter (expected '<layer>.{LORA_A}' or '<layer>.{LORA_B}')")
    return layer, part


def layer_part(layer: str) -> str | None:
    """Which part of the model a linear layer (its plain name) belongs to: attention, MLP, or the output head."""
    if ".self_attn." in layer:
        return ATTN
    if ".mlp." in layer:
        return MLP
    if layer == "lm_head":
        return UNEMBED
    return None


def expert_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's (A_e, B_e), stacked as (E, r, in) and (E, out, r), from peft's adapters of a 3-D expert
    parameter: A (E·r, in) holds expert e's rows at e·r..(e+1)·r; B (out, r·E) its columns at e, E + e, 2E + e..."""
    per_expert_a = lora_a.reshape(experts, -1, lora_a.shape[-1])
    per_expert_b = lora_b.reshape(lora_b.shape[0], -1, experts).permute(2, 0, 1)
    return per_expert_a, per_expert_b


def adapter_delta(
    weight_shape: torch.Size | tuple[int, ...], lora_a: torch.Tensor, lora_b: torch.Tensor
) -> torch.Tensor:
    """B A: what an adapter pair adds to its weight before the scaling; a linear layer's (out, in), or every
    expert's B_e A_e of an (E, out, in) expert parameter."""
    if len(weight_shape) == 2:
        return lora_b @ lora_a
    per_expert_a, per_expert_b = expert_factors(lora_a, lora_b, weight_shape[0])
    return torch.bmm(per_expert_b, per_expert_a)
