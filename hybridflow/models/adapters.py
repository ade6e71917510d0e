"""How LoRA adapters travel from the trainer to a rollout engine: under the plain model's layer name,
``<layer>.lora_A`` (rank x in_features) and ``<layer>.lora_B`` (out_features x rank), the adapted layer's
weight standing for W + scaling · B A. The trainer (engine/lora.py) names them; a rollout (rollout/) reads
the names back."""

from __future__ import annotations

LORA_A = "lora_A"
LORA_B = "lora_B"
ATTN, MLP, UNEMBED = "attn", "mlp", "unembed"  # the parts of a model an adapter may adapt


def adapter_name(layer: str, part: str) -> str:
    """The name that adapter ``part`` (LORA_A or LORA_B) of ``layer`` (model.layers.0.self_attn.q_proj) travels by."""
    return f"{layer}.{part}"


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
