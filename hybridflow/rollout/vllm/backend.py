"""vLLM as a generation backend (``rollout.name=vllm``): its registration and its checks before a run."""

from __future__ import annotations

from hybridflow.rollout.backend import BackendCheck, RolloutBackend, register_rollout_backend
from hybridflow.rollout.vllm.config import VllmEngineConfig
from hybridflow.validation import require


def _build(model, tokenizer, settings: VllmEngineConfig, tp_group):
    from hybridflow.rollout.vllm.rollout import VllmRollout

    return VllmRollout(model, tokenizer, engine_config=settings)


def kv_cache_tokens(run: BackendCheck) -> int:
    """How many tokens' keys and values ``settings.kv_cache_gb`` holds for this model in the generation dtype."""
    model = run.model_config
    head_size = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    kv_heads = getattr(model, "num_key_value_heads", None) or model.num_attention_heads
    per_token = 2 * model.num_hidden_layers * kv_heads * head_size * run.dtype.itemsize
    return int(run.settings.kv_cache_gb * 2**30) // per_token


def _check(run: BackendCheck) -> None:
    """vLLM imports here and takes the model's head size on the run's device; the run's sequences fit its
    context and its KV cache, and its scheduler's budgets agree (vLLM would refuse these only in the
    workers, after Ray started)."""
    from hybridflow.rollout.vllm.install import INSTALL_HINT, install_problem, unsupported_head_size

    problem = install_problem()
    require(
        problem is None, "name", f"vllm is chosen, but {problem}", f"install it: {INSTALL_HINT}; or rollout.name=native"
    )
    model = run.model_config
    require(
        model.model_type != "mixtral",
        "name",
        f"vllm cannot load {run.model_name}: vLLM 0.32 reads Mixtral's experts by their transformers 4 names "
        "(block_sparse_moe.experts.N.w1), and transformers 5 writes them fused (mlp.experts.gate_up_proj)",
        "use rollout.name=native or hf for it (Qwen3-MoE and OLMoE load in vLLM)",
    )
    settings: VllmEngineConfig = run.settings
    longest = settings.max_model_len or model.max_position_embeddings
    require(
        longest >= run.sequence_length,
        "vllm.max_model_len" if settings.max_model_len else "response_length",
        f"a sequence of data.max_prompt_length + rollout.response_length = {run.sequence_length} tokens does not "
        f"fit vLLM's context of {longest} tokens"
        + ("" if settings.max_model_len else f" ({run.model_name}'s max_position_embeddings)"),
        f"raise rollout.vllm.max_model_len to {run.sequence_length}"
        if settings.max_model_len
        else "lower data.max_prompt_length or rollout.response_length",
    )
    require(
        settings.max_num_batched_tokens >= settings.max_num_seqs,
        "vllm.max_num_batched_tokens",
        f"{settings.max_num_batched_tokens} is below vllm.max_num_seqs={settings.max_num_seqs}: each scheduled "
        "sequence takes at least one token of a step's budget",
        f"raise it to {settings.max_num_seqs}, or lower rollout.vllm.max_num_seqs",
    )
    capacity = kv_cache_tokens(run)
    require(
        capacity >= longest,
        "vllm.kv_cache_gb",
        f"{settings.kv_cache_gb} GiB holds the keys and values of {capacity} tokens of {run.model_name} in "
        f"{run.dtype}, less than one sequence of vLLM's context ({longest} tokens)",
        f"raise it to {longest / capacity * settings.kv_cache_gb:.2f}, or lower rollout.vllm.max_model_len (the run "
        f"needs {run.sequence_length})",
    )
    require(
        run.device != "cpu" or settings.max_num_batched_tokens >= longest,
        "vllm.max_num_batched_tokens",
        f"{settings.max_num_batched_tokens} is below the longest sequence ({longest} tokens): on CPU vLLM computes a "
        "prompt in one step (its chunked prefill is off there: vLLM 0.32 crashes when it splits a seeded request)",
        f"raise it to {longest}, or lower rollout.vllm.max_model_len",
    )
    # last: it imports vLLM's attention (seconds), so the settings' own mistakes are named at once
    head_size = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    problem = unsupported_head_size(head_size, run.device)
    require(problem is None, "name", f"vllm cannot run {run.model_name}: {problem}", "use rollout.name=native for it")


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
