"""Every branch of a session trained: the rollout hands a session's other branches with its row, the driver makes
each one a row of the session's group, and a batch grown by them is padded for the update with rows that train
nothing."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from endpoint_helpers import EOS, ScriptedBackend, params, rows, scripted_rollout
from user_agents import CALCULATOR

from hybridflow.algorithms.aggregation import count_tokens_and_seqs
from hybridflow.batch_keys import (
    AGENT_BRANCH_ROWS,
    AGENT_GENERATED_TOKENS,
    AGENT_REWARD,
    ATTENTION_MASK,
    GENERATED_MASK,
    LAST_BRANCH,
    POSITION_IDS,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    SESSION,
    TURN_ENDS,
    UID,
)
from hybridflow.models import load_tokenizer
from hybridflow.rollout.agent_server.branch_rows import drop_fillers, expand_branches, pad_to_planned
from hybridflow.rollout.agent_server.rollout import AgentFunctionRollout
from hybridflow.trainer.setup.config import default_config

TOKEN_AGENTS = Path(__file__).parent / "token_agents.py"

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "734 * 58"}}</tool_call>'
assert CALCULATOR["function"]["name"] == "calculator"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


def row_tokens(batch, row):
    width = batch.batch[PROMPTS].shape[1]
    present = batch.batch[ATTENTION_MASK][row].bool()
    prompt = batch.batch[PROMPTS][row][present[:width]].tolist()
    n = int(present[width:].sum())
    return (
        prompt,
        batch.batch[RESPONSES][row, :n].tolist(),
        batch.batch[RESPONSE_MASK][row, :n].tolist(),
        batch.batch[ROLLOUT_LOG_PROBS][row, :n].tolist(),
    )


def generated(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_an_edited_history_trains_both_branches(tokenizer):
    turns = [f"{CALL}{EOS}", f"So 42572.{EOS}", f"Checked: 42000 is wrong.{EOS}"]
    scripts = {0: list(turns), 1: [f"It is 42572.{EOS}"]}  # session 1 fails on its first reply (no tool call)
    rollout = scripted_rollout(tokenizer, "edited_history_agent", scripts)
    batch = rollout.generate_sequences(rows(["What is 734 * 58?", "What is 734 * 58?"]), params())
    payloads = batch.non_tensor_batch[AGENT_BRANCH_ROWS]
    assert payloads[1] is None  # a failed session's branches leave the update with it
    # the driver: the rows' group ids, then each session's other branches as rows of its group
    batch.non_tensor_batch[UID] = np.array(["p", "p"], dtype=object)
    expanded = expand_branches(batch)
    assert len(expanded) == 3 and AGENT_BRANCH_ROWS not in expanded.non_tensor_batch
    assert expanded.batch[LAST_BRANCH].tolist() == [True, False, True]
    assert expanded.non_tensor_batch[SESSION].tolist() == ["p/0", "p/0", "p/1"]
    assert expanded.non_tensor_batch[UID].tolist() == ["p", "p", "p"]
    assert expanded.non_tensor_batch[AGENT_REWARD].tolist()[:2] == [0.5, 0.5]  # a branch's reward: its session's

    # row 1 is the first branch, token for token: its first turn (generated), the tool's answer as the template
    # renders it (inserted), the second turn (generated), with the engine's log-probs of each generated token
    first_call = rollout.engine.calls[0][1]
    prompt, tokens, mask, log_probs = row_tokens(expanded, 1)
    assert prompt == first_call
    turn1, turn2 = generated(tokenizer, turns[0]), generated(tokenizer, turns[1])
    assert tokens[: len(turn1)] == turn1 and tokens[-len(turn2) :] == turn2
    assert mask == [1] * len(turn1) + [0] * (len(tokens) - len(turn1) - len(turn2)) + [1] * len(turn2)
    expected = [-(k + 1) / 100 for k in range(len(turn1) + len(turn2))]
    assert [p for p, m in zip(log_probs, mask) if m] == pytest.approx(expected)
    assert expanded.non_tensor_batch[TURN_ENDS][1] == [len(turn1) - 1, len(tokens) - 1]
    # row 0 is the last branch (the edit), as before
    _, tokens, mask, _ = row_tokens(expanded, 0)
    assert tokens == generated(tokenizer, turns[2]) and mask == [1] * len(tokens)

    # every token the model generated in the session is in a row of the update (the failed one's in none)
    all_generated = len(turn1) + len(turn2) + len(generated(tokenizer, turns[2]))
    assert expanded.batch[AGENT_GENERATED_TOKENS][0].item() == all_generated
    assert int(expanded.batch[RESPONSE_MASK][:2].sum()) == all_generated
    assert int(expanded.batch[RESPONSE_MASK][2].sum()) == 0


def test_padding_for_the_update_trains_nothing_and_goes_away(tokenizer):
    scripts = {i: [f"{CALL}{EOS}", f"So 42572.{EOS}", f"Checked.{EOS}"] for i in range(2)}
    rollout = scripted_rollout(tokenizer, "edited_history_agent", scripts)
    batch = rollout.generate_sequences(rows(["What is 734 * 58?"] * 2), params())
    batch.non_tensor_batch[UID] = np.array(["p", "p"], dtype=object)
    batch.batch[GENERATED_MASK] = batch.batch[RESPONSE_MASK].clone()
    expanded = expand_branches(batch)
    # each row's generated mask is its own branch's (the batch's was marked before its branches were rows)
    torch.testing.assert_close(expanded.batch[GENERATED_MASK], expanded.batch[RESPONSE_MASK])
    before = expanded.select(deepcopy=True)
    assert pad_to_planned(expanded, planned=4) == 1  # within the plan: nothing added
    assert pad_to_planned(expanded, planned=3) == 2  # 4 rows -> 6 = 2 x 3, every mini-batch twice its size
    assert len(expanded) == 6
    filler = expanded[np.array([4, 5])]
    assert filler.batch[RESPONSE_MASK].sum() == 0 and filler.batch[GENERATED_MASK].sum() == 0
    assert filler.batch[ATTENTION_MASK].sum(dim=1).tolist() == [1, 1] and filler.batch[POSITION_IDS].sum() == 0
    assert filler.batch[LAST_BRANCH].tolist() == [False, False]
    # it changes no loss: the update's token and sequence counts are the real rows'
    assert count_tokens_and_seqs(expanded.batch[RESPONSE_MASK]) == count_tokens_and_seqs(before.batch[RESPONSE_MASK])
    drop_fillers(expanded)
    assert len(expanded) == 4
    for key in (RESPONSES, RESPONSE_MASK, ATTENTION_MASK, ROLLOUT_LOG_PROBS):
        torch.testing.assert_close(expanded.batch[key], before.batch[key])


def test_the_token_route_hands_its_other_branches_too(tokenizer, tmp_path):
    """The token route (/inference/v1/generate): a context that diverges starts a branch; the first one, extended
    token for token, is trained as its own row."""
    prompt = generated(tokenizer, "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    tail = generated(tokenizer, "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")
    config = dataclasses.replace(
        default_config().actor_rollout_ref.rollout.agent, function=f"{TOKEN_AGENTS}:two_turn_token_agent"
    )
    backend = ScriptedBackend(tokenizer, {0: [f"4{EOS}", f"Yes 4{EOS}", f"Four{EOS}"]}, config.max_branches_per_session)
    rollout = AgentFunctionRollout(backend, tokenizer, config, tool_role="tool", format="hermes")
    extra = [
        {"prompt_ids": prompt, "tail_ids": tail, "stop_ids": [], "out": str(tmp_path / "out.json"), "diverge": True}
    ]
    batch = rollout.generate_sequences(rows(["x"], extra=extra), params(64))
    batch.non_tensor_batch[UID] = np.array(["p"], dtype=object)
    expanded = expand_branches(batch)
    assert expanded.batch[LAST_BRANCH].tolist() == [True, False]
    branch_prompt, tokens, mask, log_probs = row_tokens(expanded, 1)
    turn1, turn2 = generated(tokenizer, f"4{EOS}"), generated(tokenizer, f"Yes 4{EOS}")
    assert branch_prompt == prompt and tokens == turn1 + tail + turn2
    assert mask == [1] * len(turn1) + [0] * len(tail) + [1] * len(turn2)
    # the scripted engine's k-th token of an engine request: -(k + 1) / 100; the two turns are one request's
    expected = [-(k + 1) / 100 for k in range(len(turn1) + len(turn2))]
    assert log_probs == pytest.approx(expected[: len(turn1)] + [0.0] * len(tail) + expected[len(turn1) :])
