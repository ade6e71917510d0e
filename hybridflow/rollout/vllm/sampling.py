"""vLLM's sampling settings for hybridflow's `SamplingParams`: one request at a time, each with its own seed."""

from __future__ import annotations

from hybridflow.rollout.sampling import SamplingParams

_SEED_STRIDE = 1_000_003  # request i of a call with seed s samples with seed s * stride + i


def request_seed(seed: int, request: int) -> int:
    """The seed of one request's random stream: distinct per (call seed, request index), below 2^63."""
    return (seed * _SEED_STRIDE + request) % (1 << 63)


def vllm_sampling(
    params: SamplingParams, request: int, max_tokens: int, stop_token_ids: list[int], final_only: bool = False
):
    """vLLM's SamplingParams for request ``request`` of a call (its seed derives from the index); only
    ``stop_token_ids`` end it ([]: none). final_only: the engine reports the request only when it finishes
    (the request API steps the engine itself)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    sample = params.do_sample
    return VllmSamplingParams(
        temperature=params.temperature if sample else 0.0,  # vLLM: 0 is greedy
        top_p=params.top_p if sample else 1.0,
        top_k=params.top_k if sample else -1,
        max_tokens=max_tokens,
        seed=request_seed(params.seed, request),
        logprobs=0,  # the chosen token's log-prob only
        stop_token_ids=stop_token_ids,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE,
    )
