"""The GSM8K preprocessing script on a tiny hand-written copy of the original files."""

import json
import sys

import pandas as pd
import pytest

from hybridflow.data import read_rows
from hybridflow.data.preprocess.gsm8k import INSTRUCTION, main, preprocess
from hybridflow.reward import get_scorer

TRAIN = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 more than $800. Price?", "answer": "800 + 1200 = 2000\n#### 2,000"},
]
TEST = [{"question": "Half of 9?", "answer": "9 / 2 = 4.5\n#### 4.5"}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def gsm8k_dir(tmp_path):
    source = tmp_path / "grade_school_math"
    source.mkdir()
    write_jsonl(source / "train.jsonl", TRAIN)
    write_jsonl(source / "test.jsonl", TEST)
    return source


def test_rows_from_jsonl(gsm8k_dir, tmp_path):
    main(["--input", str(gsm8k_dir), "--out", str(tmp_path / "out")])
    train, test = read_rows(tmp_path / "out" / "train.parquet"), read_rows(tmp_path / "out" / "test.parquet")
    assert [r["reward_model"]["ground_truth"] for r in train] == ["7", "2000"]
    assert [r["reward_model"]["ground_truth"] for r in test] == ["4.5"]
    row = train[0]
    assert row["data_source"] == "openai/gsm8k" and row["reward_model"]["style"] == "rule"
    assert row["prompt"] == [{"role": "user", "content": f"{TRAIN[0]['question']} {INSTRUCTION}"}]
    assert "####" in row["prompt"][0]["content"]
    assert row["extra_info"] == {"split": "train", "index": 0, **TRAIN[0]}


def test_ground_truths_score_with_the_gsm8k_scorer(gsm8k_dir, tmp_path):
    paths = preprocess(gsm8k_dir, tmp_path / "out")
    scorer = get_scorer("openai/gsm8k")
    for row in read_rows(paths["train"]) + read_rows(paths["test"]):
        truth = row["reward_model"]["ground_truth"]
        assert scorer(f"Reasoning...\n#### {truth}", truth)["score"] == 1.0
        assert scorer(row["extra_info"]["answer"], truth)["score"] == 1.0  # the dataset's own solution
        assert scorer("#### 123456", truth)["score"] == 0.0


def test_parquet_input_and_single_file(tmp_path):
    source = tmp_path / "hub"
    source.mkdir()
    pd.DataFrame(TRAIN).to_parquet(source / "train-00000-of-00001.parquet")
    paths = preprocess(source, tmp_path / "out")
    assert list(paths) == ["train"]
    assert len(read_rows(paths["train"])) == 2
    single = tmp_path / "test.jsonl"
    write_jsonl(single, TEST)
    assert list(preprocess(single, tmp_path / "out2")) == ["test"]


def test_answer_without_marker_is_an_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match="####"):
        preprocess(tmp_path, tmp_path / "out")


def test_without_input_and_without_datasets_says_to_pass_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path)])
    assert exit_info.value.code == 1
    assert "--input" in capsys.readouterr().err


def test_missing_input_path(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--input", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert "does not exist" in capsys.readouterr().err
