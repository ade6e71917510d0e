"""RLHFDataset: parquet and jsonl rows, the chat template, the length filter, collate."""

import json
import logging

import pandas as pd
import pytest
import torch
from data_configs import dataset_config

from hybridflow.data import RLHFDataset
from hybridflow.validation import ConfigError, InputFileError


def chat(text):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


ROWS = [
    {
        "data_source": "arithmetic",
        "prompt": chat("What is 2 + 3?"),
        "reward_model": {"ground_truth": "5", "style": "rule"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": chat("What is the sum of 12 and 30, plus the number of days in a week times four?"),
        "reward_model": {"ground_truth": "70", "style": "rule"},
        "extra_info": {"split": "train", "index": 1},
    },
    {
        "data_source": "arithmetic",
        "prompt": chat("What is 7 * 8?"),
        "reward_model": {"ground_truth": "56", "style": "rule"},
        "extra_info": {"split": "train", "index": 2},
    },
]


def template_ids(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture
def parquet_file(tmp_path):
    path = tmp_path / "rows.parquet"
    pd.DataFrame(ROWS).to_parquet(path)  # written by pandas, not by our writer
    return path


@pytest.fixture
def jsonl_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    return path


@pytest.mark.parametrize("fixture", ["parquet_file", "jsonl_file"])
def test_rows_and_chat_template(request, fixture, tiny_tokenizer):
    dataset = RLHFDataset(str(request.getfixturevalue(fixture)), tiny_tokenizer, dataset_config())
    assert len(dataset) == 3
    for i, row in enumerate(ROWS):
        item = dataset[i]
        assert item["raw_prompt"] == row["prompt"]  # plain lists and dicts, also from parquet
        assert isinstance(item["raw_prompt"], list)
        assert item["input_ids"] == template_ids(tiny_tokenizer, row["prompt"])
        assert item["data_source"] == row["data_source"]
        assert item["reward_model"] == row["reward_model"]
        assert item["extra_info"] == row["extra_info"]
        assert item["index"] == i
    text = tiny_tokenizer.decode(dataset[0]["input_ids"])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_several_files_concatenate(parquet_file, jsonl_file, tiny_tokenizer):
    dataset = RLHFDataset([parquet_file, jsonl_file], tiny_tokenizer, dataset_config())
    assert len(dataset) == 6
    assert [dataset[i]["index"] for i in range(6)] == list(range(6))
    assert dataset[4]["reward_model"]["ground_truth"] == "70"


def test_overlong_prompts_are_dropped_and_counted(jsonl_file, tiny_tokenizer, caplog):
    lengths = [len(template_ids(tiny_tokenizer, row["prompt"])) for row in ROWS]
    assert lengths[1] > max(lengths[0], lengths[2])
    config = dataset_config(max_prompt_length=max(lengths[0], lengths[2]))
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        dataset = RLHFDataset(jsonl_file, tiny_tokenizer, config)
    assert [dataset[i]["index"] for i in range(len(dataset))] == [0, 2]  # original row numbers kept
    assert "dropped 1 of 3 rows" in caplog.text and "data.max_prompt_length" in caplog.text


def test_overlong_prompt_raises_with_the_row_index(jsonl_file, tiny_tokenizer):
    lengths = [len(template_ids(tiny_tokenizer, row["prompt"])) for row in ROWS]
    config = dataset_config(max_prompt_length=lengths[0], filter_overlong_prompts=False)
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length': row 1 "):
        RLHFDataset(jsonl_file, tiny_tokenizer, config)


def test_bad_prompt_column(tmp_path, tiny_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "hi", "data_source": "x", "reward_model": {}}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: column 'prompt' \(data.prompt_key\)"):
        RLHFDataset(path, tiny_tokenizer, dataset_config())
    with pytest.raises(InputFileError, match=r"missing.parquet' \(data.train_files\): does not exist"):
        RLHFDataset(tmp_path / "missing.parquet", tiny_tokenizer, dataset_config())


def test_other_prompt_key(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"chat": chat("hi"), "data_source": "x", "reward_model": {"ground_truth": "1"}}) + "\n")
    dataset = RLHFDataset(path, tiny_tokenizer, dataset_config(prompt_key="chat"))
    assert dataset[0]["raw_prompt"] == chat("hi") and dataset[0]["extra_info"] == {}


def test_collate_left_pads_by_hand(jsonl_file, tiny_tokenizer):
    dataset = RLHFDataset(jsonl_file, tiny_tokenizer, dataset_config())
    pad = tiny_tokenizer.pad_token_id
    rows = [
        {**dataset[0], "input_ids": [11, 12, 13]},
        {**dataset[1], "input_ids": [21, 22, 23, 24, 25]},
    ]
    batch = dataset.collate(rows)
    assert batch.batch["input_ids"].tolist() == [[pad, pad, 11, 12, 13], [21, 22, 23, 24, 25]]
    assert batch.batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.batch["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert all(batch.batch[k].dtype == torch.long for k in ("input_ids", "attention_mask", "position_ids"))
    assert batch.non_tensor_batch["data_source"].tolist() == ["arithmetic", "openai/gsm8k"]
    assert batch.non_tensor_batch["reward_model"][1] == {"ground_truth": "70", "style": "rule"}
    assert batch.non_tensor_batch["raw_prompt"].shape == (2,)  # one list of messages per row, not a 2-d array
    assert batch.non_tensor_batch["raw_prompt"][0] == ROWS[0]["prompt"]
    assert batch.non_tensor_batch["extra_info"][0] == {"split": "train", "index": 0}
    assert batch.non_tensor_batch["index"].tolist() == [0, 1]


def test_collate_of_real_rows_matches_the_template(parquet_file, tiny_tokenizer):
    dataset = RLHFDataset(parquet_file, tiny_tokenizer, dataset_config())
    batch = dataset.collate([dataset[0], dataset[1], dataset[2]])
    width = max(len(dataset[i]["input_ids"]) for i in range(3))
    assert batch.batch["input_ids"].shape == (3, width)
    for i in range(3):
        mask = batch.batch["attention_mask"][i].bool()
        assert batch.batch["input_ids"][i][mask].tolist() == template_ids(tiny_tokenizer, ROWS[i]["prompt"])
