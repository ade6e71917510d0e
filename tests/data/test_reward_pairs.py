"""The reward model's pairs: each answer is the text the RL reward worker would score (the conversation through the
chat template, tokenised whole), the pair's shared first tokens are its rows' prompt, margins are read, a long text
loses its first tokens as the worker's tokenizer cuts it, and bad rows are refused with the file and row named."""

import dataclasses

import pytest

from hybridflow.batch_keys import PAIR_MARGIN
from hybridflow.data.io import write_rows
from hybridflow.data.preference_dataset import CHOSEN, REJECTED
from hybridflow.data.reward_pairs import RewardPairDataset, shared_tokens
from hybridflow.data.token_rows import PROMPT_IDS, RESPONSE_IDS
from hybridflow.validation import ConfigError, InputFileError
from tests.data.test_preference_dataset import CONFIG, HEADER, QUESTION, encode


def dataset(tmp_path, tokenizer, rows, **changes) -> RewardPairDataset:
    path = tmp_path / "pairs.jsonl"
    write_rows(rows, path)
    return RewardPairDataset(path, tokenizer, dataclasses.replace(CONFIG, **changes))


def whole(row) -> list[int]:
    return row[PROMPT_IDS] + row[RESPONSE_IDS]


def test_each_answer_is_the_whole_scored_conversation_split_where_the_pair_differs(tmp_path, tiny_tokenizer):
    rows = [{"prompt": QUESTION, "chosen": "5", "rejected": "6", "score_gap": 1.5}]
    pair = dataset(tmp_path, tiny_tokenizer, rows, margin_key="score_gap")[0]
    assert whole(pair[CHOSEN]) == encode(tiny_tokenizer, HEADER + "5<|im_end|>\n")
    assert whole(pair[REJECTED]) == encode(tiny_tokenizer, HEADER + "6<|im_end|>\n")
    # the shared part: everything before the answers' first differing token
    assert pair[CHOSEN][PROMPT_IDS] == pair[REJECTED][PROMPT_IDS] == encode(tiny_tokenizer, HEADER)
    assert pair["margin"] == 1.5


def test_text_prompts_and_shared_prefix_conversations_render_as_the_worker_renders(tmp_path, tiny_tokenizer):
    text_prompt = {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}
    conversations = {
        "chosen": [*QUESTION, {"role": "assistant", "content": "5"}],
        "rejected": [*QUESTION, {"role": "assistant", "content": "6"}],
    }
    got = dataset(tmp_path, tiny_tokenizer, [text_prompt, conversations])
    for pair in got.pairs:
        assert whole(pair[CHOSEN]) == encode(tiny_tokenizer, HEADER + "5<|im_end|>\n")


def test_batches_interleave_pairs_with_their_margins(tmp_path, tiny_tokenizer):
    rows = [{"prompt": QUESTION, "chosen": str(i), "rejected": "no", "m": float(i)} for i in range(3)]
    data = dataset(tmp_path, tiny_tokenizer, rows, margin_key="m")
    batch = data.collate(data.pairs)
    assert batch.batch[PAIR_MARGIN].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert len(batch) == 6 and data.unit == "pairs"


def test_a_long_text_keeps_its_last_tokens_as_the_worker_does(tmp_path, tiny_tokenizer):
    rows = [{"prompt": QUESTION, "chosen": "5 " * 40, "rejected": "6"}]
    full = encode(tiny_tokenizer, HEADER + "5 " * 40 + "<|im_end|>\n")
    with pytest.raises(ConfigError, match="data.max_length"):
        dataset(tmp_path, tiny_tokenizer, rows, max_length=30)
    pair = dataset(tmp_path, tiny_tokenizer, rows, max_length=30, overlong="truncate")[0]
    assert whole(pair[CHOSEN]) == full[-30:]
    with pytest.raises(ConfigError, match="no pair"):
        dataset(tmp_path, tiny_tokenizer, rows, max_length=30, overlong="drop")


def test_bad_rows_are_named(tmp_path, tiny_tokenizer):
    with pytest.raises(InputFileError, match="row 0.*neither text nor chat messages"):
        dataset(tmp_path, tiny_tokenizer, [{"prompt": QUESTION, "chosen": 5, "rejected": "6"}])
    with pytest.raises(InputFileError, match="not a number"):
        dataset(tmp_path, tiny_tokenizer, [{"prompt": QUESTION, "chosen": "5", "rejected": "6"}], margin_key="gap")


def test_shared_tokens_leave_each_sequence_one_of_its_own():
    assert shared_tokens([1, 2, 3], [1, 2, 4]) == 2
    assert shared_tokens([1, 2], [1, 2, 3]) == 1  # one is a prefix of the other
    assert shared_tokens([5], [6]) == 0
