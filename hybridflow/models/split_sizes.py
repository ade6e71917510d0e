"""Whether a model splits evenly over tensor-parallel ranks: whole attention heads and equal MLP slices.

One rule for training (a Hugging Face config: ``check_tensor_parallel_size``), the native engine's
generation groups (its ``ModelSpec``: ``check_split_sizes``) and the planner's candidate layouts
(``indivisible_sizes``). Which modules are split, and along which dimension, is models/tensor_parallel.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _named(heads: int, kv_heads: int, intermediate_size: int, experts: int = 0) -> dict[str, int]:
    """The sizes tensor parallelism divides, by their Hugging Face config names: a mixture's experts (split
    whole between the ranks, models/tensor_parallel.py) in place of a dense MLP's width."""
    mlp = {"num_experts": experts} if experts else {"intermediate_size": intermediate_size}
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, **mlp}


def indivisible_sizes(
    size: int, *, heads: int, kv_heads: int, intermediate_size: int, experts: int = 0
) -> dict[str, int]:
    """The model's sizes (by config name) that ``size`` ranks cannot split evenly; empty when it splits."""
    return {name: value for name, value in _named(heads, kv_heads, intermediate_size, experts).items() if value % size}


def check_split_sizes(
    size: int, key: str, *, heads: int, kv_heads: int, intermediate_size: int, experts: int = 0
) -> None:
    """ValueError naming ``key`` when ``size`` ranks cannot each hold whole query and key/value heads
    and an equal slice of the MLP (a mixture's: an equal share of its experts); the message lists the sizes to
    choose a divisor of."""
    bad = indivisible_sizes(size, heads=heads, kv_heads=kv_heads, intermediate_size=intermediate_size, experts=experts)
    if bad:
        sizes = _named(heads, kv_heads, intermediate_size, experts)
        raise ValueError(
            f"{key}={size} does not divide the model's {bad}: choose a common divisor of "
            f"{', '.join(f'{name}={value}' for name, value in sizes.items())}"
        )


def shares_heads(size: int, *, heads: int) -> bool:
    """Whether each of ``size`` Ulysses ranks attends with at least one of the ``heads`` query heads (engine/
    sequence_parallel.py pads heads that ``size`` does not divide, and repeats key/value heads as needed)."""
    return size <= heads


def check_sequence_parallel_size(config: PretrainedConfig, size: int, key: str, tensor_parallel: int = 1) -> None:
    """ValueError naming ``key`` when ``size`` Ulysses ranks are more than the attention heads of a tensor-parallel
    shard (``shares_heads``; ``tensor_parallel`` ranks split the heads first)."""
    heads = config.num_attention_heads // tensor_parallel
    if not shares_heads(size, heads=heads):
        split = f" per tensor-parallel rank ({config.num_attention_heads} over {tensor_parallel})"
        raise ValueError(
            f"{key}={size} is more ranks than the model's {heads} attention heads{split if tensor_parallel > 1 else ''}"
            f": each rank attends with whole heads; choose at most {heads} (a divisor of {heads} wastes no attention "
            "work)"
        )


def check_tensor_parallel_size(config: PretrainedConfig, size: int, key: str) -> None:
    """``check_split_sizes`` with the sizes of a Hugging Face config (a mixture: each rank its share of the
    experts)."""
    check_split_sizes(
        size,
        key,
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        experts=expert_count(config),
    )


def expert_count(config: PretrainedConfig) -> int:
    """The experts of each MoE layer of a Hugging Face config (0: a dense model)."""
    text = config.get_text_config()
    return int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)


def check_expert_parallel_size(config: PretrainedConfig, size: int, data_parallel: int) -> None:
    """ValueError unless ``size`` ranks, among ``data_parallel`` ones, can each hold an equal share of every MoE
    layer's experts."""
    experts = expert_count(config)
    if not experts:
        raise ValueError(f"{size}: the model ({config.model_type}) has no mixture-of-experts layers to split")
    if experts % size:
        raise ValueError(f"{size} does not divide the model's {experts} experts")
    if data_parallel % size:
        raise ValueError(f"{size} does not divide the {data_parallel} data-parallel ranks")
