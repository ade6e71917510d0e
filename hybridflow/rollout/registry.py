"""Generation backends by name (``actor_rollout_ref.rollout.name``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from hybridflow.rollout.base import Rollout

if TYPE_CHECKING:  # rollout/config.py checks rollout.name against ROLLOUT_BACKENDS
    from hybridflow.rollout.config import RolloutConfig

# (model, tokenizer, config, tp_group): tp_group holds the ranks generating together (None: one rank)
RolloutFactory = Callable[[nn.Module, PreTrainedTokenizerBase, "RolloutConfig", "dist.ProcessGroup | None"], Rollout]
TENSOR_PARALLEL_BACKENDS = ("native",)  # the backends that take rollout.tensor_model_parallel_size > 1
MULTI_TURN_BACKENDS = ("native", "vllm")  # the backends with a request API (rollout/requests.py) for agent loops


def _hf(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig, tp_group: dist.ProcessGroup | None
) -> Rollout:
    from hybridflow.rollout.hf_rollout import HFRollout

    return HFRollout(model, tokenizer)


def _native(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig, tp_group: dist.ProcessGroup | None
) -> Rollout:
    from hybridflow.rollout.native import NativeRollout

    return NativeRollout(model, tokenizer, engine_config=config.native, tp_group=tp_group)


def _vllm(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig, tp_group: dist.ProcessGroup | None
) -> Rollout:
    from hybridflow.rollout.vllm.rollout import VllmRollout

    return VllmRollout(model, tokenizer, engine_config=config.vllm)


ROLLOUT_BACKENDS: dict[str, RolloutFactory] = {"hf": _hf, "native": _native, "vllm": _vllm}


def register_rollout(name: str, factory: RolloutFactory) -> None:
    """Add a backend (e.g. an adapter for SGLang) usable as ``rollout.name``."""
    if name in ROLLOUT_BACKENDS:
        raise ValueError(f"rollout backend '{name}' is already registered")
    ROLLOUT_BACKENDS[name] = factory


def build_rollout(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    config: RolloutConfig,
    tp_group: dist.ProcessGroup | None = None,
) -> Rollout:
    """The backend ``config.name`` over ``model``, tensor-parallel over ``tp_group`` when given; with
    ``multi_turn.enable``, agent loops over that backend's request engine (rollout/agent)."""
    if config.name not in ROLLOUT_BACKENDS:
        raise ValueError(f"unknown rollout backend '{config.name}'; known: {sorted(ROLLOUT_BACKENDS)}")
    backend = ROLLOUT_BACKENDS[config.name](model, tokenizer, config, tp_group)
    if not config.multi_turn.enable:
        return backend
    from hybridflow.rollout.agent import AgentRollout

    return AgentRollout(backend, tokenizer, config.multi_turn)
