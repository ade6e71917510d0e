"""vLLM as a generation backend (``rollout.name=vllm``): its registration and its checks before a run."""

from __future__ import annotations

from hybridflow.rollout.backend import BackendCheck, RolloutBackend, register_rollout_backend
from hybridflow.rollout.vllm.config import VllmEngineConfig
from hybridflow.validation import require


def _build(model, tokenizer, settings: VllmEngineConfig, tp_group):
    from hybridflow.rollout.vllm.rollout import VllmRollout

    return VllmRollout(model, tokenizer, engine_config=settings)


def _check(run: BackendCheck) -> None:
    """vLLM imports here, takes the model's head size on the run's device, and fits a sequence in one step."""
    from hybridflow.rollout.vllm.install import INSTALL_HINT, install_problem, unsupported_head_size

    problem = install_problem()
    require(
        problem is None, "name", f"vllm is chosen, but {problem}", f"install it: {INSTALL_HINT}; or rollout.name=native"
    )
    model = run.model_config
    head_size = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    problem = unsupported_head_size(head_size, run.device)
    require(problem is None, "name", f"vllm cannot run {run.model_name}: {problem}", "use rollout.name=native for it")
    settings: VllmEngineConfig = run.settings
    longest = settings.max_model_len or model.max_position_embeddings
    require(
        run.device != "cpu" or settings.max_num_batched_tokens >= longest,
        "vllm.max_num_batched_tokens",
        f"{settings.max_num_batched_tokens} is below the longest sequence ({longest} tokens): on CPU vLLM computes a "
        "prompt in one step (its chunked prefill is off there: vLLM 0.32 crashes when it splits a seeded request)",
        f"raise it to {longest}, or lower rollout.vllm.max_model_len",
    )


VLLM = register_rollout_backend(
    RolloutBackend(
        name="vllm",
        summary="vLLM's engine in the worker's process (pip install 'hybridflow[vllm]')",
        build=_build,
        settings=VllmEngineConfig,
        request_api=True,
        check=_check,
    )
)
