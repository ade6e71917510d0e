"""Whether a model splits evenly over tensor-parallel ranks: whole attention heads and equal MLP slices."""

from __future__ import annotations

from transformers import PretrainedConfig


def check_tensor_parallel_size(config: PretrainedConfig, size: int, key: str) -> None:
    """ValueError naming ``key`` when ``size`` ranks cannot each hold whole query and key/value heads
    and an equal slice of the MLP; the message lists the sizes to choose a divisor of."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = {name: value for name, value in sizes.items() if value % size}
    if bad:
        raise ValueError(
            f"{key}={size} does not divide the model's {bad}: choose a common divisor of "
            f"{', '.join(f'{name}={value}' for name, value in sizes.items())}"
        )
