"""The agent loops on vLLM through the same request API: the conversations equal the native engine's and
transformers', and a later turn reuses vLLM's cache of the earlier ones."""

import dataclasses

import pytest
import torch
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of

from hybridflow.batch_keys import ATTENTION_MASK, RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from hybridflow.rollout.agent import AgentLoop, AgentRollout, RequestState
from hybridflow.rollout.native import NativeRollout
from hybridflow.tools import ToolSet
from hybridflow.trainer.setup.config import default_config

pytestmark = pytest.mark.slow

INSERTED = ["tool says 42 and more", "ok then"]
TURN_TOKENS = 5


class ThreeTurns(AgentLoop):
    """Three turns of up to 5 tokens with fixed text inserted (as tool messages) between them."""

    async def run(self, trajectory, context):
        trajectory.move_to(RequestState.GENERATING)
        new_tokens = trajectory.prompt
        for inserted in [*INSERTED, None]:
            turn = await context.engine.generate(trajectory.request, new_tokens, TURN_TOKENS)
            trajectory.add_generated(turn)
            if inserted is None:
                break
            new_tokens = context.chat.tool_response_ids([inserted])
            trajectory.add_inserted(new_tokens)
        trajectory.finish("no_tool_call")


def _agent(backend, tokenizer):
    config = dataclasses.replace(default_config().actor_rollout_ref.rollout.multi_turn, enable=True)
    config = dataclasses.replace(config, default_agent=f"{__file__}:ThreeTurns")
    return AgentRollout(backend, tokenizer, config, ToolSet())


def test_multi_turn_on_vllm_equals_the_native_engine_and_a_forward_pass(tiny):
    model, tokenizer, rollout = tiny  # an engine with 32-token cache blocks (conftest.py)
    prompts = prompts_of(tokenizer, QUESTIONS)
    on_vllm = _agent(rollout, tokenizer)
    got = on_vllm.generate_sequences(prompts, greedy(64)).batch
    native = NativeRollout(model, tokenizer, engine_config=engine_config())
    expected = _agent(native, tokenizer).generate_sequences(prompts, greedy(64)).batch
    for key in (RESPONSES, RESPONSE_MASK, ATTENTION_MASK):
        assert torch.equal(got[key], expected[key]), key
    generated = got[RESPONSE_MASK].bool()
    assert generated.sum() >= len(QUESTIONS) * 3  # every turn generated
    with torch.no_grad():
        logits = model(input_ids=got["input_ids"], attention_mask=got[ATTENTION_MASK]).logits
    prompt_len = got["prompts"].shape[1]
    log_probs = logits[:, prompt_len - 1 : -1].float().log_softmax(-1).gather(-1, got[RESPONSES][..., None])[..., 0]
    assert torch.allclose(got[ROLLOUT_LOG_PROBS][generated], log_probs[generated], atol=1e-5)

    # each later turn's prompt is the conversation so far: vLLM found it cached and computed little more than
    # what was appended (prefix caching reuses whole blocks, so up to a block of the old context is recomputed)
    stats = on_vllm.engine.stats
    block = rollout.llm.llm_engine.vllm_config.cache_config.block_size
    prompt_tokens = int(prompts.batch[ATTENTION_MASK].sum())
    appended = sum(len(on_vllm.chat.tool_response_ids([text])) for text in INSERTED) * len(QUESTIONS)
    last_turn_tokens = 2 * len(QUESTIONS)  # the previous turn's last token is new to the engine too
    assert stats.turns == 3 * len(QUESTIONS)
    assert stats.prefill_tokens <= prompt_tokens + appended + last_turn_tokens + 2 * block * len(QUESTIONS)
    contexts = int(got[ATTENTION_MASK].sum()) * 3  # more than what re-prefilling every turn from scratch costs
    assert stats.prefill_tokens < contexts / 2
