"""The endpoint over the native engine (fp32 tiny model): a three-turn conversation's sample is token for token what
the engine generated plus the rendered tool and user tails, and its behaviour log-probs are the trainer's; on a
mixture of experts, every branch's row carries the experts each of its tokens went through (routing replay)."""

import dataclasses

import numpy as np
import torch
from endpoint_helpers import agent_config, params, rows
from rollout_helpers import engine_config, perturbed

from hybridflow.batch_keys import (
    AGENT_BRANCHES,
    AGENT_FAILURE,
    ATTENTION_MASK,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    UID,
)
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.agent_server.branch_rows import expand_branches
from hybridflow.rollout.agent_server.rollout import AgentFunctionRollout
from hybridflow.rollout.native import NativeRollout
from tests.models.test_routing import assert_every_fed_token_has_the_experts_it_went_through


def test_a_three_turn_sample_is_what_the_engine_produced_with_the_trainers_log_probs():
    model = load_causal_lm("tiny-llama", dtype=torch.float32).eval()
    tokenizer = load_tokenizer("tiny-llama")
    native = NativeRollout(model, tokenizer, engine_config=engine_config(), stop_token_ids=[])
    rollout = AgentFunctionRollout(native, tokenizer, agent_config("three_turn_agent", max_prompt_tokens=64),
                                   tool_role="tool", format="hermes")  # fmt: skip
    batch = rollout.generate_sequences(rows(["Hi", "What is 734 * 58?"]), params(96))
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["", ""]
    assert batch.batch[AGENT_BRANCHES].tolist() == [1, 1]
    chat = rollout.renderer.chat
    end = chat.prefix[-1]
    width = batch.batch[PROMPTS].shape[1]
    for row in range(2):
        prompt_mask = batch.batch[ATTENTION_MASK][row, :width].bool()
        prompt = batch.batch[PROMPTS][row][prompt_mask].tolist()
        n = int(batch.batch[ATTENTION_MASK][row, width:].sum())
        tokens = batch.batch[RESPONSES][row, :n].tolist()
        mask = batch.batch[RESPONSE_MASK][row, :n].tolist()
        # three generated turns; between them, exactly the rendered tails (an end token first where a turn was cut)
        runs, start = [], 0
        for i in range(1, n + 1):
            if i == n or mask[i] != mask[start]:
                runs.append((mask[start], tokens[start:i]))
                start = i
        assert [kind for kind, _ in runs] == [1, 0, 1, 0, 1]
        for _, turn in runs[::2]:
            assert 1 <= len(turn) <= 8
        tool_tail = chat.continuation_ids([{"role": "tool", "content": "42572", "tool_call_id": "call_0"}])
        user_tail = chat.continuation_ids([{"role": "user", "content": "Sure?"}])
        for (_, turn), (_, inserted), tail in ((runs[0], runs[1], tool_tail), (runs[2], runs[3], user_tail)):
            assert inserted == ([] if turn[-1] == end else [end]) + tail
        # the behaviour log-probs are the trainer's: one forward over the whole sample, fp32
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0] * torch.tensor(mask)
        torch.testing.assert_close(batch.batch[ROLLOUT_LOG_PROBS][row, :n], expected, rtol=0, atol=1e-5)


def test_after_a_weight_update_no_turn_uses_the_old_weights_cache():
    """Two generation calls with a weight load between them: the second call's samples (same agent, same prompts)
    have the new weights' log-probs on every token, its first turns and the turns continued from the cache alike."""
    model = load_causal_lm("tiny-llama", dtype=torch.float32).eval()
    tokenizer = load_tokenizer("tiny-llama")
    native = NativeRollout(model, tokenizer, engine_config=engine_config(), stop_token_ids=[])
    config = agent_config("three_turn_agent", max_prompt_tokens=64)
    rollout = AgentFunctionRollout(native, tokenizer, config, tool_role="tool", format="hermes")
    rollout.generate_sequences(rows(["Hi", "What is 734 * 58?"]), params(96))
    updated = perturbed(model)
    rollout.load_weights(updated.state_dict().items())
    batch = rollout.generate_sequences(rows(["Hi", "What is 734 * 58?"]), params(96))
    width = batch.batch[PROMPTS].shape[1]
    for row in range(2):
        prompt = batch.batch[PROMPTS][row][batch.batch[ATTENTION_MASK][row, :width].bool()].tolist()
        n = int(batch.batch[ATTENTION_MASK][row, width:].sum())
        tokens = batch.batch[RESPONSES][row, :n].tolist()
        mask = torch.tensor(batch.batch[RESPONSE_MASK][row, :n].tolist())
        with torch.no_grad():
            logits = updated(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0] * mask
        torch.testing.assert_close(batch.batch[ROLLOUT_LOG_PROBS][row, :n], expected, rtol=0, atol=1e-5)


def test_every_branch_of_a_session_carries_the_experts_its_tokens_went_through():
    """Two sessions of two branches each (two turns, then an edited history) on a tiny OLMoE, recording routes: each
    of the four rows has the experts of every real token but its last, the first branch's too (its engine request
    released when the edit started another), and they are the trainer's own choices: replaying them changes none."""
    model = load_causal_lm("tiny-olmoe", dtype=torch.float32).eval()
    tokenizer = load_tokenizer("tiny-olmoe")
    native = NativeRollout(model, tokenizer, engine_config=engine_config(), stop_token_ids=[])
    rollout = AgentFunctionRollout(native, tokenizer, agent_config("branching_agent", max_prompt_tokens=64),
                                   tool_role="tool", format="hermes")  # fmt: skip
    recording = dataclasses.replace(params(64), record_routes=True)
    batch = rollout.generate_sequences(rows(["Hi", "What is 734 * 58?"]), recording)
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["", ""]
    assert batch.batch[AGENT_BRANCHES].tolist() == [2, 2]
    batch.non_tensor_batch[UID] = np.array(["a", "b"], dtype=object)
    expanded = expand_branches(batch)
    assert len(expanded) == 4
    assert_every_fed_token_has_the_experts_it_went_through(model, expanded)
