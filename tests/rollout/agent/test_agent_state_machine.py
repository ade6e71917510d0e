"""The tool agent's state machine on scripted model outputs: transitions, stop conditions, tool failures, and the
tokens and masks of a trajectory checked by hand."""

import asyncio
import time

import pytest
import torch
from agent_helpers import EOS, HangingTool, RaisingTool, RecordingTool, call, scripted_rollout
from rollout_helpers import greedy, prompts_of

from hybridflow.batch_keys import (
    AGENT_FAILURE,
    AGENT_NAME,
    ATTENTION_MASK,
    EXTRA_INFO,
    NUM_TURNS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    STOP_REASON,
    TOOL_CALLS,
    TOOL_ERRORS,
    TOOL_REWARDS,
    TRUNCATED,
    TURN_ENDS,
    TURN_SCORES,
)
from hybridflow.models import load_tokenizer
from hybridflow.rollout.agent import AgentLoop, RequestState, register_agent_loop
from hybridflow.rollout.agent.loops import AGENT_LOOPS
from hybridflow.tools.calculator import CalculatorTool

S = RequestState


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


def _run(tokenizer, scripts, tools=None, budget=400, agent_names=None, extra_info=None, **config):
    """Generate for one prompt per script; returns (the batch, the agent rollout)."""
    rollout = scripted_rollout(tokenizer, scripts, tools, **config)
    prompts = prompts_of(tokenizer, [f"question {r}" for r in scripts])
    if agent_names is not None:
        prompts.non_tensor_batch[AGENT_NAME] = agent_names
    if extra_info is not None:
        prompts.non_tensor_batch[EXTRA_INFO] = extra_info
    return rollout.generate_sequences(prompts, greedy(budget)), rollout


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _delta(tokenizer, *answers):
    """What ChatML puts after an assistant turn's <|im_end|> for these tool answers, written out by hand."""
    text = "".join(f"\n<|im_start|>tool\n{a}<|im_end|>" for a in answers) + "\n<|im_start|>assistant\n"
    return _ids(tokenizer, text)


def _response(batch, row=0):
    n = int(batch.batch[ATTENTION_MASK][row, -batch.batch[RESPONSES].shape[1] :].sum())
    return batch.batch[RESPONSES][row, :n].tolist()


def test_a_two_tool_call_trajectory_token_by_token(tokenizer):
    turns = [
        call("calculator", '{"expression": "2+3"}') + EOS,
        call("calculator", '{"expression": "5*4"}') + EOS,
        "The answer is 20" + EOS,
    ]
    batch, rollout = _run(tokenizer, {0: turns})
    t1, t2, t3 = (_ids(tokenizer, t) for t in turns)
    d1, d2 = _delta(tokenizer, "5"), _delta(tokenizer, "20")
    expected = t1 + d1 + t2 + d2 + t3
    assert _response(batch) == expected
    mask = [1] * len(t1) + [0] * len(d1) + [1] * len(t2) + [0] * len(d2) + [1] * len(t3)
    n = len(expected)
    assert batch.batch[RESPONSE_MASK][0, :n].tolist() == mask
    assert batch.batch[RESPONSE_MASK][0, n:].sum() == 0 and batch.batch[ATTENTION_MASK][0, -400:].sum() == n
    # log-probs: the engine's, in generation order, on generated tokens only
    generated = len(t1) + len(t2) + len(t3)
    expected_lp = torch.zeros(n)
    expected_lp[torch.tensor(mask, dtype=torch.bool)] = -torch.arange(1, generated + 1, dtype=torch.float32) / 100
    torch.testing.assert_close(batch.batch[ROLLOUT_LOG_PROBS][0, :n], expected_lp)
    # what the engine was given each turn: the prompt, then only the inserted tokens
    given = rollout.engine.given[0]
    assert given[1:] == [d1, d2] and len(given[0]) > 0
    assert batch.batch[NUM_TURNS][0] == 3 and batch.batch[TOOL_CALLS][0] == 2 and batch.batch[TOOL_ERRORS][0] == 0
    assert batch.non_tensor_batch[STOP_REASON][0] == "no_tool_call" and not batch.batch[TRUNCATED][0]
    ends = [len(t1) - 1, len(t1 + d1 + t2) - 1, n - 1]
    assert batch.non_tensor_batch[TURN_ENDS][0] == ends
    assert rollout.engine.released == {0}


def test_every_transition_is_recorded_and_illegal_ones_are_refused(tokenizer):
    from hybridflow.rollout.agent.state import IllegalTransition, Trajectory

    turns = [call("calculator", '{"expression": "1+1"}') + EOS, "2" + EOS]
    rollout = scripted_rollout(tokenizer, {0: turns})
    prompts = prompts_of(tokenizer, ["q"])
    trajectories = asyncio.run(
        rollout._run_all([prompts.batch["input_ids"][0].tolist()], [("tool_agent", {})], greedy(100))
    )
    assert trajectories[0].history == [S.PENDING, S.GENERATING, S.RUNNING_TOOLS, S.GENERATING, S.FINISHED]
    trajectory = Trajectory(request=0, prompt=[1])
    with pytest.raises(IllegalTransition, match="pending -> running_tools"):
        trajectory.move_to(S.RUNNING_TOOLS)
    trajectory.move_to(S.GENERATING)
    trajectory.finish("no_tool_call")
    with pytest.raises(IllegalTransition, match="finished -> generating"):
        trajectory.move_to(S.GENERATING)


@pytest.mark.parametrize(
    "scripts, config, reason, turns",
    [
        # the budget runs out inside a turn
        ({0: ["1 2 3 4 5 6 7 8 9 " * 30 + EOS]}, {}, "length", 1),
        # every turn calls a tool: the assistant-turn limit ends it (the last turn's call is not run)
        (
            {0: [call("calculator", '{"expression": "1"}') + EOS] * 5},
            {"max_assistant_turns": 3},
            "max_assistant_turns",
            3,
        ),
        # the user-turn limit (turns of tool output) ends it
        ({0: [call("calculator", '{"expression": "1"}') + EOS] * 5}, {"max_user_turns": 1}, "max_user_turns", 2),
        # a turn without a tool call: the answer
        ({0: ["42" + EOS]}, {}, "no_tool_call", 1),
    ],
)
def test_stop_conditions(tokenizer, scripts, config, reason, turns):
    batch, _ = _run(tokenizer, scripts, budget=400, **config)
    assert batch.non_tensor_batch[STOP_REASON][0] == reason
    assert batch.batch[NUM_TURNS][0] == turns
    assert bool(batch.batch[TRUNCATED][0]) == (reason != "no_tool_call")
    assert int(batch.batch[ATTENTION_MASK][0, -400:].sum()) <= 400


def test_tool_output_that_does_not_fit_ends_the_trajectory(tokenizer):
    first = call("calculator", '{"expression": "10**50"}') + EOS
    budget = len(_ids(tokenizer, first)) + 5  # room for the call, not for its 51-digit answer
    batch, _ = _run(tokenizer, {0: [first, "x" + EOS]}, budget=budget)
    assert batch.non_tensor_batch[STOP_REASON][0] == "length"
    assert _response(batch) == _ids(tokenizer, first)  # nothing inserted


@pytest.mark.parametrize(
    "bad_turn, message",
    [
        ("<tool_call>{not json}</tool_call>" + EOS, "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>' + EOS, 'JSON object {"name"'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>' + EOS, "must be a JSON object"),
        ('<tool_call>{"name": "calculator"' + EOS, "was not closed"),
        (call("nope", "{}") + EOS, "no tool named 'nope'"),
        (call("calculator", '{"expr": "1"}') + EOS, "needs the argument(s) expression"),
        (call("calculator", '{"expression": "import os"}') + EOS, "Error:"),
        (call("broken", "{}") + EOS, "broken failed: ValueError: boom"),
    ],
)
def test_bad_calls_and_failing_tools_answer_with_an_error_and_the_loop_goes_on(tokenizer, bad_turn, message):
    batch, _ = _run(tokenizer, {0: [bad_turn, "sorry" + EOS]}, tools=[CalculatorTool(), RaisingTool()])
    text = tokenizer.decode(_response(batch))
    assert message in text and text.endswith("sorry" + EOS)
    assert batch.batch[TOOL_ERRORS][0] == 1 and batch.batch[TOOL_CALLS][0] == 1
    assert batch.non_tensor_batch[STOP_REASON][0] == "no_tool_call"


def test_a_hanging_tool_times_out_and_the_others_are_not_held_up(tokenizer):
    scripts = {
        0: [call("hang", "{}") + EOS, "ok" + EOS],
        1: [call("calculator", '{"expression": "2*21"}') + EOS, "42" + EOS],
    }
    start = time.perf_counter()
    batch, _ = _run(tokenizer, scripts, tools=[CalculatorTool(), HangingTool()], tool_timeout_s=0.3)
    assert time.perf_counter() - start < 3
    assert "hang did not answer within 0.3 s" in tokenizer.decode(_response(batch, 0))
    assert batch.batch[TOOL_ERRORS].tolist() == [1, 0]
    assert "42" in tokenizer.decode(_response(batch, 1))


def test_parallel_calls_run_together_up_to_the_limit(tokenizer):
    echo = RecordingTool(delay_s=0.3)
    three = "".join(call("echo", f'{{"text": "{w}"}}') for w in ("a", "b", "c")) + EOS
    start = time.perf_counter()
    batch, _ = _run(tokenizer, {0: [three, "done" + EOS]}, tools=[echo], max_parallel_calls=2)
    assert time.perf_counter() - start < 0.55  # two calls of 0.3 s, together
    assert echo.most_active == 2
    text = tokenizer.decode(_response(batch))
    assert "\na<|im_end|>" in text and "\nb<|im_end|>" in text and "at most 2 tool call(s) per turn" in text
    assert batch.batch[TOOL_CALLS][0] == 3 and batch.batch[TOOL_ERRORS][0] == 1


def test_tool_output_is_cut_to_the_token_limit(tokenizer):
    long = "7" * 40
    batch, _ = _run(
        tokenizer,
        {0: [call("echo", f'{{"text": "{long}"}}') + EOS, "k" + EOS]},
        tools=[RecordingTool()],
        max_tool_response_length=10,
    )
    assert _response(batch)[-3:] != []  # finished
    inserted = [t for t, m in zip(_response(batch), batch.batch[RESPONSE_MASK][0].tolist()) if m == 0]
    assert "\n" + "7" * 5 + "...(30 tokens cut)..." + "7" * 5 + "<|im_end|>" in tokenizer.decode(inserted)


def test_tools_get_their_kwargs_rewards_reach_the_batch_and_instances_are_released(tokenizer):
    echo = RecordingTool()
    turn = call("echo", '{"text": "x"}') + call("echo", '{"text": "y"}') + EOS
    extra = [{"tools_kwargs": {"echo": {"create_kwargs": {"bonus": 2.0}}}}, {}]
    batch, _ = _run(tokenizer, {0: [turn, "z" + EOS], 1: ["no tools" + EOS]}, tools=[echo], extra_info=extra)
    assert echo.created == {"0": {"bonus": 2.0}}  # created once, at its first call, with the row's kwargs
    assert echo.released == ["0"]
    assert batch.non_tensor_batch[TURN_SCORES][0] == [0.5, 0.0]  # two calls of 0.25 in the first turn
    assert batch.non_tensor_batch[TOOL_REWARDS][0] == {"echo": 2.0}
    assert batch.non_tensor_batch[TOOL_REWARDS][1] == {}


class ExplodingLoop(AgentLoop):
    async def run(self, trajectory, context):
        trajectory.move_to(RequestState.GENERATING)
        turn = await context.engine.generate(trajectory.request, trajectory.prompt, 5)
        trajectory.add_generated(turn)
        raise RuntimeError("my loop has a bug")


def test_a_failing_loop_marks_its_row_failed_and_the_others_finish(tokenizer):
    register_agent_loop("exploding_for_test", ExplodingLoop)
    try:
        names = ["exploding_for_test", "single_turn"]
        batch, rollout = _run(tokenizer, {0: ["abc" + EOS], 1: ["fine" + EOS]}, agent_names=names)
    finally:
        del AGENT_LOOPS["exploding_for_test"]
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["RuntimeError: my loop has a bug", ""]
    assert batch.non_tensor_batch[STOP_REASON].tolist() == ["failed", "no_tool_call"]
    assert batch.batch[RESPONSE_MASK][0].sum() == 0  # it leaves the update
    assert _response(batch, 0) == _ids(tokenizer, "abc" + EOS)  # but its tokens are kept
    assert batch.batch[RESPONSE_MASK][1].sum() == len(_ids(tokenizer, "fine" + EOS))
    assert rollout.engine.released == {0, 1}


def test_a_loop_from_a_file(tokenizer, tmp_path):
    path = tmp_path / "my_loop.py"
    path.write_text(
        "from hybridflow.rollout.agent import AgentLoop, RequestState\n"
        "class Twice(AgentLoop):\n"
        "    async def run(self, trajectory, context):\n"
        "        trajectory.move_to(RequestState.GENERATING)\n"
        "        for new in (trajectory.prompt, [5, 6]):\n"
        "            turn = await context.engine.generate(trajectory.request, new, 10)\n"
        "            if new != trajectory.prompt:\n"
        "                trajectory.add_inserted(new)\n"
        "            trajectory.add_generated(turn)\n"
        "        trajectory.finish('no_tool_call')\n"
    )
    batch, _ = _run(tokenizer, {0: ["a" + EOS, "b" + EOS]}, agent_names=[f"{path}:Twice"])
    assert _response(batch) == _ids(tokenizer, "a" + EOS) + [5, 6] + _ids(tokenizer, "b" + EOS)
    assert batch.non_tensor_batch[AGENT_FAILURE][0] == ""
