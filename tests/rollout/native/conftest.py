"""The tiny fp32 models of the native-engine tests (helpers are in ../rollout_helpers.py)."""

import pytest
import torch

from hybridflow.models import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-qwen3-moe", "tiny-olmoe"])
def tiny(request):
    """(name, fp32 HF model, tokenizer) for the tiny families: untied Llama, tied Qwen2 with q/k/v biases, and the
    mixtures of experts (2 of 4 per token) Mixtral, Qwen3-MoE (q/k norms per head, tied, renormalised routing) and
    OLMoE (q/k norms over all heads, routing weights not renormalised)."""
    model = load_causal_lm(request.param, dtype=torch.float32).eval()
    return request.param, model, load_tokenizer(request.param)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are dispatch-bound: one thread is as fast, and immune to other jobs on the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
