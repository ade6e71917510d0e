"""Generation backends (``actor_rollout_ref.rollout.name``): each one a descriptor it registers itself.

A backend lives in its own folder under rollout/ (native/, vllm/, hf/) and describes itself once, in
that folder's ``backend.py``, with a ``RolloutBackend``: its name, the dataclass of its own settings
(the section ``actor_rollout_ref.rollout.<name>.*``, whose defaults are in the run's YAML), a factory
that builds its ``Rollout``, what it can do (tensor-parallel generation, the request API that
multi-turn agent loops drive) and its own checks before a run starts. Nothing outside its folder
imports it: the rest of hybridflow reaches a backend through this registry only, so a new backend
(SGLang one day) is a folder with a ``backend.py`` and its name in ``BUILTIN_BACKENDS``.

The rollout config (rollout/config.py) gets one section per registered backend that has settings,
so a backend registered from elsewhere must be registered before that module is first imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from hybridflow.rollout.base import Rollout

# the backends that ship with hybridflow: the module that registers each (imported on first use)
BUILTIN_BACKENDS = {
    "native": "hybridflow.rollout.native.backend",
    "vllm": "hybridflow.rollout.vllm.backend",
    "hf": "hybridflow.rollout.hf.backend",
}


@dataclass(frozen=True, kw_only=True)
class BackendCheck:
    """What a backend's check before the run sees: its own settings, the policy model, the device."""

    settings: Any  # the backend's section (rollout.<name>), or None for a backend without settings
    model_name: str  # the policy as the config names it (for messages)
    model_config: PretrainedConfig  # the policy's Hugging Face config
    device: str  # cpu | cuda
    dtype: torch.dtype  # the generation dtype (rollout.dtype, resolved for the device)
    sequence_length: int  # the longest sequence the run generates: data.max_prompt_length + rollout.response_length


# (model, tokenizer, the backend's settings or None, the tensor-parallel group or None) -> its Rollout.
# tp_group holds the ranks generating together (only for backends with tensor_parallel=True). A backend with
# pipeline_stages=True also takes pp_group=, the ranks whose stages hold the decoder layers between them.
RolloutFactory = Callable[[nn.Module, PreTrainedTokenizerBase, Any, "dist.ProcessGroup | None"], Rollout]


@dataclass(frozen=True, kw_only=True)
class RolloutBackend:
    name: str  # the value of actor_rollout_ref.rollout.name
    summary: str  # one line for help and error messages
    build: RolloutFactory
    settings: type | None = None  # dataclass of actor_rollout_ref.rollout.<name>.* (None: no settings)
    tensor_parallel: bool = False  # generates in groups of rollout.tensor_model_parallel_size > 1 ranks
    pipeline_stages: bool = False  # generates in rollout.pipeline_model_parallel_size > 1 stages (build's pp_group)
    request_api: bool = False  # has Rollout.request_engine(), which multi-turn agent loops drive
    partial_rollout: bool = False  # has Rollout.generate_partial(): pauses at a weight push, continues after it
    records_routes: bool = False  # a mixture of experts: returns routed_experts when SamplingParams.record_routes
    # raises InvalidSetting (field relative to the rollout section, e.g. "vllm.max_num_batched_tokens")
    check: Callable[[BackendCheck], None] | None = None


_BACKENDS: dict[str, RolloutBackend] = {}
_sections_taken = False  # set once rollout/config.py has composed its sections from the registry


def register_rollout_backend(backend: RolloutBackend) -> RolloutBackend:
    """Make ``backend`` usable as ``rollout.name``; returns it (so a module can keep it as a constant)."""
    if backend.name in _BACKENDS:
        raise ValueError(f"rollout backend '{backend.name}' is already registered")
    if backend.settings is not None and _sections_taken:
        raise RuntimeError(
            f"rollout backend '{backend.name}' has settings, but the rollout config was already composed: "
            "register it before hybridflow.rollout.config is imported"
        )
    _BACKENDS[backend.name] = backend
    return backend


def _load_builtins() -> None:
    for name, module in BUILTIN_BACKENDS.items():
        if name not in _BACKENDS:
            importlib.import_module(module)  # registers it


def rollout_backends() -> dict[str, RolloutBackend]:
    """Every registered backend by name, the built-in ones included."""
    _load_builtins()
    return dict(_BACKENDS)


def rollout_backend(name: str) -> RolloutBackend:
    """The backend registered as ``name``; KeyError listing the known ones."""
    backends = rollout_backends()
    if name not in backends:
        raise KeyError(f"unknown rollout backend '{name}'; known: {', '.join(sorted(backends))}")
    return backends[name]


def backend_sections() -> dict[str, type]:
    """The settings dataclass of each backend that has one, by name (the rollout config's sections);
    after this call, backends with settings can no longer be registered."""
    global _sections_taken
    sections = {name: backend.settings for name, backend in rollout_backends().items() if backend.settings}
    _sections_taken = True
    return sections
