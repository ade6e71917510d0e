"""Agent loops on the native engine: requests run concurrently, a slow tool holds up only its own request, slots
are shared, and the batch is what transformers computes for the same conversations."""

import asyncio
import copy

import pytest
import torch
from agent_helpers import multi_turn_config
from lora_helpers import lora_model
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of

from hybridflow.batch_keys import AGENT_FAILURE, ATTENTION_MASK, RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from hybridflow.engine.lora import adapter_tensors, base_parameters, lora_scaling
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.agent import AgentLoop, AgentRollout, RequestState, register_agent_loop
from hybridflow.rollout.agent.loops import AGENT_LOOPS
from hybridflow.rollout.native import NativeRollout
from hybridflow.tools import ToolSet

TOOL_TEXT = "result: 42"


class SlowToolLoop(AgentLoop):
    """Two turns of 6 tokens with a "tool" between them. Request 0's tool answers only once every other request
    has finished both its turns (or fails after 60 s): it completes only if the engine serves the others while
    request 0 waits, with its context parked in the cache."""

    others_left: int = 0
    others_done: asyncio.Event | None = None

    async def run(self, trajectory, context):
        cls = type(self)
        if cls.others_done is None:
            cls.others_done = asyncio.Event()
        trajectory.move_to(RequestState.GENERATING)
        trajectory.add_generated(await context.engine.generate(trajectory.request, trajectory.prompt, 6))
        trajectory.move_to(RequestState.RUNNING_TOOLS)
        if trajectory.request == 0:
            await asyncio.wait_for(cls.others_done.wait(), timeout=60)
        inserted = context.tokenizer.encode(TOOL_TEXT, add_special_tokens=False)
        trajectory.add_inserted(inserted)
        trajectory.move_to(RequestState.GENERATING)
        trajectory.add_generated(await context.engine.generate(trajectory.request, inserted, 6))
        trajectory.finish("no_tool_call")
        if trajectory.request != 0:
            cls.others_left -= 1
            if cls.others_left == 0:
                cls.others_done.set()


@pytest.fixture(scope="module")
def tiny_llama():
    model = load_causal_lm("tiny-llama", dtype=torch.float32).eval()
    return model, load_tokenizer("tiny-llama")


@pytest.fixture(scope="module", autouse=True)
def slow_tool_loop():
    register_agent_loop("slow_tool_for_test", SlowToolLoop)
    yield
    del AGENT_LOOPS["slow_tool_for_test"]


def _agent_rollout(model, tokenizer, max_num_seqs):
    native = NativeRollout(model, tokenizer, engine_config=engine_config(max_num_seqs=max_num_seqs), stop_token_ids=[])
    config = multi_turn_config(default_agent="slow_tool_for_test")
    return AgentRollout(native, tokenizer, config, ToolSet())


@pytest.mark.parametrize("max_num_seqs", [2, 16])
def test_a_slow_tool_holds_up_only_its_own_request(tiny_llama, max_num_seqs):
    model, tokenizer = tiny_llama
    questions = QUESTIONS + ["one more", "and the last"]
    rollout = _agent_rollout(model, tokenizer, max_num_seqs)
    SlowToolLoop.others_left, SlowToolLoop.others_done = len(questions) - 1, None
    batch = rollout.generate_sequences(prompts_of(tokenizer, questions), greedy(24))
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == [""] * len(questions)  # request 0 did not time out
    stats = rollout.engine.stats
    assert stats.turns == 2 * len(questions)
    if max_num_seqs == 2:
        # with 2 slots, request 0 held one while its tool ran: the others took turns in the other slot
        assert stats.slot_moves == 0  # ragged decode (the default): a request keeps its slot between turns

    # the conversations are what transformers computes: each turn greedy on the whole context so far
    tool = tokenizer.encode(TOOL_TEXT, add_special_tokens=False)
    prompts = prompts_of(tokenizer, questions).batch
    for row in range(len(questions)):
        prompt = prompts["input_ids"][row][prompts["attention_mask"][row].bool()].tolist()
        n = int(batch.batch[ATTENTION_MASK][row, -24:].sum())
        response = batch.batch[RESPONSES][row, :n].tolist()
        assert n == 6 + len(tool) + 6 and response[6 : 6 + len(tool)] == tool
        assert batch.batch[RESPONSE_MASK][row, :n].tolist() == [1] * 6 + [0] * len(tool) + [1] * 6
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        generated = batch.batch[RESPONSE_MASK][row, :n].bool()
        assert torch.equal(logits.argmax(-1)[generated], torch.tensor(response)[generated])
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0] * generated
        torch.testing.assert_close(batch.batch[ROLLOUT_LOG_PROBS][row, :n], expected, rtol=1e-4, atol=1e-4)


def test_agent_loops_run_on_a_lora_policy_served_as_on_its_merged_model(tiny_llama):
    """The request API's turns go through the same matrices: adapters served there are the merged model's policy."""
    model, tokenizer = tiny_llama
    peft_model = lora_model(copy.deepcopy(model))
    served = _agent_rollout(model, tokenizer, 16)
    served.load_base_weights(base_parameters(peft_model))
    served.load_adapters(adapter_tensors(peft_model), lora_scaling(peft_model))
    merged = _agent_rollout(copy.deepcopy(peft_model).merge_and_unload(), tokenizer, 16)
    batches = []
    for rollout in (served, merged, _agent_rollout(model, tokenizer, 16)):
        SlowToolLoop.others_left, SlowToolLoop.others_done = len(QUESTIONS) - 1, None
        batches.append(rollout.generate_sequences(prompts_of(tokenizer, QUESTIONS), greedy(24)).batch)
    with_adapters, expected, base = batches
    assert torch.equal(with_adapters[RESPONSES], expected[RESPONSES])
    mask = expected[RESPONSE_MASK].bool()
    torch.testing.assert_close(
        with_adapters[ROLLOUT_LOG_PROBS][mask], expected[ROLLOUT_LOG_PROBS][mask], atol=1e-4, rtol=0
    )
    assert (with_adapters[ROLLOUT_LOG_PROBS] - base[ROLLOUT_LOG_PROBS])[mask].abs().max() > 1e-2  # they matter
