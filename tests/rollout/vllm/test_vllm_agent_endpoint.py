"""The agent endpoint over vLLM: an openai-SDK agent's three-turn conversations are the same tokens as over the native
engine, with the same masks, and vLLM's log-probs are the forward pass's."""

import pytest
import torch
from agent_server.endpoint_helpers import agent_config, rows
from rollout_helpers import engine_config

from hybridflow.batch_keys import AGENT_FAILURE, ATTENTION_MASK, PROMPTS, RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from hybridflow.rollout.agent_server.rollout import AgentFunctionRollout
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeRollout

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tiny", ["tiny-llama"], indirect=True)  # one family: the endpoint does not depend on it
def test_the_endpoint_on_vllm_gives_the_native_engines_conversations(tiny):
    model, tokenizer, rollout = tiny
    config = agent_config("three_turn_agent", max_prompt_tokens=64)
    params = SamplingParams.greedy(max_new_tokens=96, seed=0)
    questions = rows(["Hi", "What is 734 * 58?"])
    got = AgentFunctionRollout(rollout, tokenizer, config, tool_role="tool", format="hermes")
    got = got.generate_sequences(questions.select(deepcopy=True), params)
    native = NativeRollout(model, tokenizer, engine_config=engine_config(), stop_token_ids=[])
    expected = AgentFunctionRollout(native, tokenizer, config, tool_role="tool", format="hermes")
    expected = expected.generate_sequences(questions.select(deepcopy=True), params)
    assert got.non_tensor_batch[AGENT_FAILURE].tolist() == ["", ""]
    for key in (PROMPTS, RESPONSES, RESPONSE_MASK, ATTENTION_MASK):
        assert torch.equal(got.batch[key], expected.batch[key]), key
    width = got.batch[PROMPTS].shape[1]
    for row in range(2):
        prompt = got.batch[PROMPTS][row][got.batch[ATTENTION_MASK][row, :width].bool()].tolist()
        n = int(got.batch[ATTENTION_MASK][row, width:].sum())
        tokens, mask = got.batch[RESPONSES][row, :n].tolist(), got.batch[RESPONSE_MASK][row, :n]
        assert mask.sum() > 0 and (mask == 0).sum() > 0  # generated turns and inserted tails
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        forward = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0] * mask
        torch.testing.assert_close(got.batch[ROLLOUT_LOG_PROBS][row, :n], forward, rtol=0, atol=1e-4)
