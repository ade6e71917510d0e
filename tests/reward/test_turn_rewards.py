"""Multi-turn rewards: the reward function sees the conversation, the score sits on the last generated token, and
tool rewards go to the turn that earned them (turn_level) or to the end."""

import dataclasses

import numpy as np
import pytest
import torch
from reward_configs import TOLERANT

from hybridflow.algorithms.estimators import compute_gae_advantage
from hybridflow.protocol import DataProto
from hybridflow.reward import RewardManager
from hybridflow.reward.turns import place_rewards
from hybridflow.trainer.setup.config import default_config


def test_place_rewards_by_hand():
    scores = torch.tensor([1.0, 0.0])
    last = torch.tensor([6, 2])
    ends = [[1, 4, 6], [2]]
    turn_scores = [[0.5, 0.25, 0.0], [0.0]]
    tool_rewards = [{"calculator": 2.0}, {}]
    summed = place_rewards(8, scores, last, ends, turn_scores, tool_rewards, coef=0.5, turn_level=False)
    expected = torch.zeros(2, 8)
    expected[0, 6] = 1.0 + 0.5 * (0.5 + 0.25 + 2.0)  # everything on the last generated token
    assert torch.equal(summed, expected)
    per_turn = place_rewards(8, scores, last, ends, turn_scores, tool_rewards, coef=0.5, turn_level=True)
    expected = torch.zeros(2, 8)
    expected[0, 1], expected[0, 4], expected[0, 6] = 0.25, 0.125, 1.0 + 1.0  # turns' rewards where they ended
    assert torch.equal(per_turn, expected)
    off = place_rewards(8, scores, last, ends, turn_scores, tool_rewards, coef=0.0, turn_level=True)
    assert off[0].tolist() == [0, 0, 0, 0, 0, 0, 1.0, 0] and off[1].sum() == 0


def _multi_turn_batch(tokenizer):
    """One conversation: turn 1 "a" + eos, tool output "7" inserted, turn 2 "b 7" + eos; then padding."""
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    turn1, inserted, turn2 = ids("a") + [eos], ids("\ntool\n7\n"), ids("b 7") + [eos]
    tokens = turn1 + inserted + turn2
    generated = [1] * len(turn1) + [0] * len(inserted) + [1] * len(turn2) + [0] * 3
    present = [1] * len(tokens) + [0] * 3
    responses = torch.tensor([tokens + [pad] * 3])
    prompts = torch.full((1, 2), pad)
    batch = DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.tensor([[1, 1] + present]),
            "response_mask": torch.tensor([generated]),
            "num_turns": torch.tensor([2]),
            "tool_calls": torch.tensor([1]),
            "tool_errors": torch.tensor([0]),
        },
        {
            "data_source": np.array(["seen"], dtype=object),
            "reward_model": [{"ground_truth": "7"}],
            "extra_info": [{"tag": 1}],
            "turn_ends": [[len(turn1) - 1, len(tokens) - 1]],
            "turn_scores": [[0.5, 0.0]],
            "tool_rewards": [{"calculator": 0.25}],
            "stop_reason": np.array(["no_tool_call"], dtype=object),
        },
    )
    return batch, len(turn1) - 1, len(tokens) - 1


def test_the_reward_function_sees_the_whole_conversation_and_its_facts(tiny_tokenizer):
    batch, first_end, last = _multi_turn_batch(tiny_tokenizer)
    seen = {}

    def reward(data_source, solution_str, ground_truth, extra_info):
        seen.update(text=solution_str, info=extra_info)
        return 1.0

    result = RewardManager(tiny_tokenizer, TOLERANT, custom_fn=reward)(batch)
    assert seen["text"].replace(" ", "") == "a<|im_end|>\ntool\n7\nb7<|im_end|>".replace(" ", "").replace(
        "<|im_end|>", ""
    )  # special tokens skipped, tool output kept
    assert seen["info"] == {
        "tag": 1,
        "final_response": "b 7",
        "num_turns": 2,
        "tool_calls": 1,
        "tool_errors": 0,
        "turn_scores": [0.5, 0.0],
        "tool_rewards": {"calculator": 0.25},
        "stop_reason": "no_tool_call",
    }
    assert batch.non_tensor_batch["extra_info"][0] == {"tag": 1}  # the row's own dict is not changed
    scores = result.token_level_scores[0]
    assert scores[last] == pytest.approx(1.0 + 0.5 + 0.25) and scores.sum() == pytest.approx(1.75)

    turn_level = dataclasses.replace(TOLERANT, turn_level=True)
    scores = RewardManager(tiny_tokenizer, turn_level, custom_fn=reward)(batch).token_level_scores[0]
    assert scores[first_end] == 0.5 and scores[last] == pytest.approx(1.25) and scores.sum() == pytest.approx(1.75)


def test_turn_level_rewards_credit_only_the_turns_before_them_under_gae(tiny_tokenizer):
    """With gamma = lam = 1 and zero values, a token's GAE advantage is the sum of the rewards at and after it:
    with the first turn's tool reward placed on that turn, tokens of the second turn do not get it."""
    batch, first_end, last = _multi_turn_batch(tiny_tokenizer)
    reward = lambda *args: 0.0  # noqa: E731
    config = dataclasses.replace(TOLERANT, turn_level=True)
    scores = RewardManager(tiny_tokenizer, config, custom_fn=reward)(batch).token_level_scores
    mask = batch.batch["response_mask"]
    gae = dataclasses.replace(default_config().algorithm, gamma=1.0, lam=1.0, gae_whiten=False)
    index = np.array(["0"], dtype=object)
    advantages, _ = compute_gae_advantage(scores, mask, index, gae, values=torch.zeros_like(scores))
    assert advantages[0, first_end] == pytest.approx(0.75)  # its own 0.5, and the 0.25 at the end
    assert advantages[0, last] == pytest.approx(0.25)  # the second turn: only what came at its end
    assert advantages[0][mask[0] == 0].abs().sum() == 0  # inserted tokens get nothing
