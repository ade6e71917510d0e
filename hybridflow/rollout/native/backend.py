"""The native engine as a generation backend (``rollout.name=native``, the default)."""

from __future__ import annotations

from hybridflow.rollout.backend import RolloutBackend, register_rollout_backend
from hybridflow.rollout.native.config import NativeEngineConfig


def _build(model, tokenizer, settings: NativeEngineConfig, tp_group):
    from hybridflow.rollout.native.rollout import NativeRollout

    return NativeRollout(model, tokenizer, engine_config=settings, tp_group=tp_group)


NATIVE = register_rollout_backend(
    RolloutBackend(
        name="native",
        summary="hybridflow's own engine: continuous batching, KV-cache slots, tensor-parallel groups",
        build=_build,
        settings=NativeEngineConfig,
        tensor_parallel=True,
        request_api=True,
        partial_rollout=True,
    )
)
