"""Preference pairs: each answer's loss mask covers exactly its assistant tokens, written out by hand for the tiny
ChatML template; both row forms (a prompt with answers, whole conversations sharing a prefix); the batch interleaves
the pairs; bad rows are refused with the file and row named."""

import dataclasses

import pytest

from hybridflow.batch_keys import INDEX, PAIR_MARGIN, RESPONSE_MASK, RESPONSES
from hybridflow.data.config import PreferenceDatasetConfig
from hybridflow.data.io import write_rows
from hybridflow.data.preference_dataset import CHOSEN, REJECTED, PreferenceDataset
from hybridflow.data.token_rows import LOSS_MASK, PROMPT_IDS, RESPONSE_IDS
from hybridflow.validation import ConfigError, InputFileError
from tests.data.test_sft_dataset import THINKING_TEMPLATE, with_template

CONFIG = PreferenceDatasetConfig(
    prompt_key="prompt",
    chosen_key="chosen",
    rejected_key="rejected",
    margin_key="",
    tools_key="",
    max_length=512,
    overlong="error",
)
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
HEADER = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


def dataset(tmp_path, tokenizer, rows, **changes) -> PreferenceDataset:
    path = tmp_path / "pairs.jsonl"
    write_rows(rows, path)
    return PreferenceDataset(path, tokenizer, dataclasses.replace(CONFIG, **changes))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_each_answer_is_the_assistant_turn_after_the_templated_prompt(tmp_path, tiny_tokenizer):
    data = dataset(tmp_path, tiny_tokenizer, [{"prompt": QUESTION, "chosen": "5", "rejected": "6, I think"}])
    (pair,) = data.pairs
    for side, text in ((CHOSEN, "5"), (REJECTED, "6, I think")):
        row = pair[side]
        assert row[PROMPT_IDS] == encode(tiny_tokenizer, HEADER)
        assert row[RESPONSE_IDS] == encode(tiny_tokenizer, text + "<|im_end|>")
        assert row[LOSS_MASK] == [1] * len(row[RESPONSE_IDS])
    assert data.trained_tokens() == len(pair[CHOSEN][RESPONSE_IDS]) + len(pair[REJECTED][RESPONSE_IDS])


def test_conversations_sharing_a_prefix_take_it_as_the_prompt_and_train_only_the_assistant(tmp_path, tiny_tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    chosen = [*QUESTION, {"role": "assistant", "content": call}, {"role": "tool", "content": "5"},
              {"role": "assistant", "content": "5"}]  # fmt: skip
    rejected = [*QUESTION, {"role": "assistant", "content": "6"}]
    (pair,) = dataset(tmp_path, tiny_tokenizer, [{"chosen": chosen, "rejected": rejected}]).pairs
    pieces = [(call + "<|im_end|>", 1), ("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", 0),
              ("5<|im_end|>", 1)]  # fmt: skip
    ids = [encode(tiny_tokenizer, text) for text, _ in pieces]
    assert pair[CHOSEN][PROMPT_IDS] == encode(tiny_tokenizer, HEADER)
    assert pair[CHOSEN][RESPONSE_IDS] == ids[0] + ids[1] + ids[2]
    assert pair[CHOSEN][LOSS_MASK] == [1] * len(ids[0]) + [0] * len(ids[1]) + [1] * len(ids[2])
    assert pair[REJECTED][RESPONSE_IDS] == encode(tiny_tokenizer, "6<|im_end|>")
    # the same pair given as a prompt column and the messages after it
    explicit = dataset(
        tmp_path, tiny_tokenizer, [{"prompt": QUESTION, "chosen": chosen[1:], "rejected": rejected[1:]}]
    ).pairs[0]
    assert explicit == pair


def test_a_text_prompt_gets_the_answer_and_an_end_token(tmp_path, tiny_tokenizer):
    (pair,) = dataset(tmp_path, tiny_tokenizer, [{"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6"}]).pairs
    assert pair[CHOSEN][PROMPT_IDS] + pair[CHOSEN][RESPONSE_IDS] == encode(tiny_tokenizer, "2 + 3 =") + encode(
        tiny_tokenizer, " 5<|im_end|>"
    )


def test_the_batch_interleaves_pairs_chosen_first_with_their_margins(tmp_path, tiny_tokenizer):
    rows = [
        {"prompt": QUESTION, "chosen": "5", "rejected": "six", "score_gap": 2.0},
        {"prompt": [{"role": "user", "content": "And 4 + 4?"}], "chosen": "8", "rejected": "nine", "score_gap": 0.5},
    ]
    data = dataset(tmp_path, tiny_tokenizer, rows, margin_key="score_gap")
    batch = data.collate([data[1], data[0]])
    assert len(batch) == 4
    assert list(batch.non_tensor_batch[INDEX]) == [1, 1, 0, 0]
    assert batch.batch[PAIR_MARGIN].tolist() == [0.5, 0.5, 2.0, 2.0]
    trained = [tiny_tokenizer.decode(batch.batch[RESPONSES][i][batch.batch[RESPONSE_MASK][i].bool()]) for i in range(4)]
    assert trained == ["8<|im_end|>", "nine<|im_end|>", "5<|im_end|>", "six<|im_end|>"]


def test_overlong_answers_stop_drop_their_pair_or_are_cut(tmp_path, tiny_tokenizer):
    long_answer = "many words " * 40
    rows = [{"prompt": QUESTION, "chosen": "5", "rejected": long_answer}, {"prompt": QUESTION, "chosen": "5",
            "rejected": "6"}]  # fmt: skip
    limit = len(encode(tiny_tokenizer, HEADER)) + 20
    with pytest.raises(ConfigError, match="row 0 of .*pairs.jsonl: an answer is .* tokens long") as caught:
        dataset(tmp_path, tiny_tokenizer, rows, max_length=limit)
    assert caught.value.key == "data.max_length"
    assert len(dataset(tmp_path, tiny_tokenizer, rows, max_length=limit, overlong="drop")) == 1
    cut = dataset(tmp_path, tiny_tokenizer, rows, max_length=limit, overlong="truncate")
    assert len(cut) == 2 and len(cut[0][REJECTED][PROMPT_IDS] + cut[0][REJECTED][RESPONSE_IDS]) == limit


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": QUESTION, "chosen": "5"}, "column 'rejected' is neither text nor chat messages"),
        ({"prompt": QUESTION, "chosen": "5", "rejected": 6}, "column 'rejected' is neither text"),
        ({"chosen": "5", "rejected": "6"}, "the answers are text but the row has no prompt column"),
        (
            {"prompt": QUESTION, "chosen": "5", "rejected": [{"role": "assistant", "content": "6"}]},
            "one of 'chosen' and 'rejected' is text and the other messages",
        ),
        (
            {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
            "share no first message",
        ),
        ({"chosen": QUESTION, "rejected": [*QUESTION, {"role": "assistant", "content": "6"}]}, "no assistant"),
        (
            {
                "prompt": "text",
                "chosen": [{"role": "assistant", "content": "5"}],
                "rejected": [{"role": "assistant", "content": "6"}],
            },
            "the prompt must be chat messages too",
        ),  # fmt: skip
    ],
)
def test_bad_rows_are_named_with_their_file_and_row(tmp_path, tiny_tokenizer, row, message):
    good = {"prompt": QUESTION, "chosen": "5", "rejected": "6"}
    with pytest.raises(InputFileError, match=f"row 1: .*{message}") as caught:
        dataset(tmp_path, tiny_tokenizer, [good, row])
    assert "pairs.jsonl" in str(caught.value)


def test_a_margin_that_is_not_a_number_is_named(tmp_path, tiny_tokenizer):
    with pytest.raises(InputFileError, match="row 0: column 'gap' .* is not a number"):
        dataset(tmp_path, tiny_tokenizer, [{"prompt": QUESTION, "chosen": "5", "rejected": "6", "gap": "big"}],
                margin_key="gap")  # fmt: skip


def test_an_answer_the_template_splits_into_several_sequences_is_refused(tmp_path, tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, THINKING_TEMPLATE)
    answer = [{"role": "assistant", "content": "<think>a</think>5"}, {"role": "user", "content": "sure?"},
              {"role": "assistant", "content": "<think>b</think>yes"}]  # fmt: skip
    row = {"prompt": QUESTION, "chosen": answer, "rejected": [{"role": "assistant", "content": "6"}]}
    with pytest.raises(InputFileError, match="renders as 2 sequences"):
        dataset(tmp_path, tokenizer, [row])


def test_bad_settings_name_their_field():
    from hybridflow.validation import InvalidSetting

    with pytest.raises(InvalidSetting) as caught:
        dataclasses.replace(CONFIG, rejected_key="chosen")
    assert caught.value.field == "rejected_key"
