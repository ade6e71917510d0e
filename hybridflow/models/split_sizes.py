"""Whether a model splits evenly over tensor-parallel ranks: whole attention heads and equal MLP slices.

One rule for training (a Hugging Face config: ``check_tensor_parallel_size``), the native engine's
generation groups (its ``ModelSpec``: ``check_split_sizes``) and the planner's candidate layouts
(``indivisible_sizes``). Which modules are split, and along which dimension, is models/tensor_parallel.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _named(heads: int, kv_heads: int, intermediate_size: int) -> dict[str, int]:
    """The sizes tensor parallelism divides, by their Hugging Face config names."""
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate_size}


def indivisible_sizes(size: int, *, heads: int, kv_heads: int, intermediate_size: int) -> dict[str, int]:
    """The model's sizes (by config name) that ``size`` ranks cannot split evenly; empty when it splits."""
    return {name: value for name, value in _named(heads, kv_heads, intermediate_size).items() if value % size}


def check_split_sizes(size: int, key: str, *, heads: int, kv_heads: int, intermediate_size: int) -> None:
    """ValueError naming ``key`` when ``size`` ranks cannot each hold whole query and key/value heads
    and an equal slice of the MLP; the message lists the sizes to choose a divisor of."""
    bad = indivisible_sizes(size, heads=heads, kv_heads=kv_heads, intermediate_size=intermediate_size)
    if bad:
        sizes = _named(heads, kv_heads, intermediate_size)
        raise ValueError(
            f"{key}={size} does not divide the model's {bad}: choose a common divisor of "
            f"{', '.join(f'{name}={value}' for name, value in sizes.items())}"
        )


def shares_heads(size: int, *, heads: int, kv_heads: int) -> bool:
    """Whether ``size`` Ulysses ranks can share the attention heads: each rank attends with whole query heads (``size``
    divides them), and the key/value heads split over the ranks or are repeated up to them (one divides the other)."""
    return heads % size == 0 and (kv_heads % size == 0 or size % kv_heads == 0)


def check_sequence_parallel_size(config: PretrainedConfig, size: int, key: str) -> None:
    """ValueError naming ``key`` when ``size`` Ulysses ranks cannot share the attention heads (``shares_heads``)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not shares_heads(size, heads=heads, kv_heads=kv_heads):
        raise ValueError(
            f"{key}={size} cannot share the model's attention heads (num_attention_heads={heads}, "
            f"num_key_value_heads={kv_heads}): choose a divisor of {heads} that {kv_heads} divides or that divides it"
        )


def check_tensor_parallel_size(config: PretrainedConfig, size: int, key: str) -> None:
    """``check_split_sizes`` with the sizes of a Hugging Face config."""
    check_split_sizes(
        size,
        key,
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        intermediate_size=config.intermediate_size,
    )
