"""The native engine as a generation backend (``rollout.name=native``, the default)."""

from __future__ import annotations

from hybridflow.rollout.backend import BackendCheck, RolloutBackend, register_rollout_backend
from hybridflow.rollout.native.config import NativeEngineConfig
from hybridflow.rollout.native.spec import spec_from_config
from hybridflow.validation import InvalidSetting


def _build(model, tokenizer, settings: NativeEngineConfig, tp_group, pp_group=None):
    from hybridflow.rollout.native.rollout import NativeRollout

    return NativeRollout(model, tokenizer, engine_config=settings, tp_group=tp_group, pp_group=pp_group)


def _check(run: BackendCheck) -> None:
    """The engine implements the policy's family (before Ray starts, not in the workers)."""
    try:
        spec_from_config(run.model_config)
    except NotImplementedError as error:
        raise InvalidSetting(
            "name",
            f"native cannot generate with {run.model_name} ({run.model_config.model_type}): {error}",
            "use rollout.name=hf (transformers' generate: any family) or vllm",
        ) from None


NATIVE = register_rollout_backend(
    RolloutBackend(
        name="native",
        summary="hybridflow's own engine: continuous batching, KV-cache slots, tensor-parallel groups, pipeline stages",
        build=_build,
        settings=NativeEngineConfig,
        tensor_parallel=True,
        pipeline_stages=True,
        request_api=True,
        partial_rollout=True,
        records_routes=True,
        check=_check,
    )
)
