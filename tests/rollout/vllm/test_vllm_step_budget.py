"""More prompt tokens than one vLLM step computes, with a seed per request: on CPU vLLM 0.32 crashed when it split
a seeded request's prompt over two steps ("CPU Generator does not use offset"); prompts now wait for a step whole."""

import dataclasses
import gc

import pytest
import torch
from conftest import tiny_head32_path
from rollout_helpers import QUESTIONS, prompts_of, sampled

from hybridflow.batch_keys import ATTENTION_MASK, RESPONSE_MASK
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.vllm.rollout import VllmRollout
from hybridflow.trainer.setup.config import default_config

pytestmark = pytest.mark.slow

STEP_TOKENS = 64  # tokens one engine step may compute (and the longest prompt + response)


@pytest.fixture(scope="module")
def small_steps():
    path = tiny_head32_path("tiny-llama")
    model = load_causal_lm(path, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    config = dataclasses.replace(
        default_config().actor_rollout_ref.rollout.vllm,
        max_num_batched_tokens=STEP_TOKENS,
        max_model_len=STEP_TOKENS,
        max_num_seqs=16,
        kv_cache_gb=0.25,
    )
    rollout = VllmRollout(model, tokenizer, engine_config=config)
    yield tokenizer, rollout
    rollout.release_cache()
    del rollout
    gc.collect()


def test_seeded_prompts_beyond_a_steps_budget_generate(small_steps):
    tokenizer, rollout = small_steps
    prompts = prompts_of(tokenizer, QUESTIONS[:3] * 4)  # 12 prompts of ~10-25 tokens: several steps' worth
    assert int(prompts.batch[ATTENTION_MASK].sum()) > 2 * STEP_TOKENS
    params = sampled(seed=3, max_new_tokens=8)
    first = rollout.generate_sequences(prompts, params).batch
    again = rollout.generate_sequences(prompts, params).batch
    assert first[RESPONSE_MASK].sum() > 12
    assert torch.equal(first["responses"], again["responses"])  # each request's own seed, whatever the steps
