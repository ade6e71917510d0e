"""Tiny fp32 models that vLLM's CPU attention can run (head size 32), and one engine per model for a module."""

import dataclasses
import gc

import pytest
import torch

from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.rollout.vllm.rollout import VllmRollout
from hybridflow.trainer.setup.config import default_config

# vLLM's CPU attention takes head sizes from 32 up; the default tiny models have 16
HEAD_32 = {"num_attention_heads": 2, "num_key_value_heads": 1}


def tiny_head32_path(name: str) -> str:
    return str(resolve_model_path(name, **HEAD_32))


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tiny(request):
    """(fp32 HF model, tokenizer, a VllmRollout over it) for both tiny families (untied Llama, tied Qwen2
    with q/k/v biases). Tests that load other weights load the model's back before they end."""
    path = tiny_head32_path(request.param)
    model = load_causal_lm(path, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    # 32-token cache blocks: a multi-turn request's next turn reuses whole blocks, and these conversations are short
    config = dataclasses.replace(default_config().actor_rollout_ref.rollout.vllm, block_size=32)
    rollout = VllmRollout(model, tokenizer, engine_config=config)
    yield model, tokenizer, rollout
    rollout.release_cache()
    # vLLM's process-wide state (its process groups) goes with its engine: free this one now, before the next
    # module starts its own, not whenever the garbage collector gets to it
    del rollout
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are dispatch-bound: one thread is as fast, and immune to other jobs on the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
