"""GSM8K to RLHFDataset rows: `python -m hybridflow.data.preprocess.gsm8k --input PATH --out DIR`.

PATH is the original data, read locally: a folder holding train*/test* files (.jsonl as in
github.com/openai/grade-school-math, or .parquet as on the Hugging Face hub), or one such
file. Each record has `question` and `answer`, the answer ending in "#### <number>". DIR
gets train.parquet and test.parquet with data_source "openai/gsm8k", the number after
"####" (commas removed) as ground truth, and a prompt asking to end with "#### <answer>",
the format the strict gsm8k scorer requires.

Without --input the script tries the `datasets` library (hub id openai/gsm8k, config
"main"), which only works where that library is installed and the hub is reachable.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from hybridflow.data.io import read_rows, write_rows

DATA_SOURCE = "openai/gsm8k"
HUB_ID = "openai/gsm8k"
SPLITS = ("train", "test")
INSTRUCTION = 'Let\'s think step by step, then write the final answer as a number after "####", like "#### 42".'
_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_answer(solution: str) -> str:
    """The number after "####" in a GSM8K answer, without thousands commas."""
    match = _ANSWER.search(solution)
    if match is None:
        raise ValueError(f"no '#### <number>' in the GSM8K answer {solution[-80:]!r}")
    return match.group(1).replace(",", "")


def to_rows(records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """GSM8K records ({question, answer}) to dataset rows."""
    rows = []
    for index, record in enumerate(records):
        question, solution = record["question"], record["answer"]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "reward_model": {"ground_truth": extract_answer(solution), "style": "rule"},
                "extra_info": {"split": split, "index": index, "question": question, "answer": solution},
            }
        )
    return rows


def find_split_files(path: Path) -> dict[str, Path]:
    """{split: file} from a folder of train*/test* files, or from one file named after its split."""
    if path.is_file():
        splits = [s for s in SPLITS if path.name.startswith(s)]
        if not splits:
            raise ValueError(f"cannot tell the split of {str(path)!r}: its name should start with 'train' or 'test'")
        return {splits[0]: path}
    if not path.is_dir():
        raise FileNotFoundError(f"--input {str(path)!r} does not exist")
    found = {}
    for split in SPLITS:
        files = sorted(p for p in path.iterdir() if p.name.startswith(split) and p.suffix in (".jsonl", ".parquet"))
        if len(files) > 1:
            raise ValueError(f"several {split} files in {str(path)!r}: {[p.name for p in files]}; keep one")
        if files:
            found[split] = files[0]
    if not found:
        raise FileNotFoundError(f"no train*.jsonl/.parquet or test*.jsonl/.parquet files in {str(path)!r}")
    return found


def load_from_hub() -> dict[str, list[dict[str, Any]]]:
    """Both splits through `datasets`, or a RuntimeError telling the user to pass --input."""
    hint = (
        "download GSM8K (e.g. train.jsonl and test.jsonl from github.com/openai/grade-school-math, "
        "folder grade_school_math/data) and pass its folder with --input"
    )
    try:
        import datasets
    except ImportError:
        raise RuntimeError(f"no --input given and the `datasets` library is not installed; {hint}") from None
    try:
        loaded = datasets.load_dataset(HUB_ID, "main")
        return {split: [dict(r) for r in loaded[split]] for split in SPLITS}
    except Exception as error:  # noqa: BLE001  (offline, hub errors: all lead to the same advice)
        raise RuntimeError(f"loading {HUB_ID} from the hub failed ({type(error).__name__}: {error}); {hint}") from None


def preprocess(input_path: str | Path | None, out: str | Path) -> dict[str, Path]:
    """Write OUT/<split>.parquet for each split found; returns the written paths."""
    if input_path is None:
        records = load_from_hub()
    else:
        records = {split: read_rows(file) for split, file in find_split_files(Path(input_path)).items()}
    return {split: write_rows(to_rows(rows, split), Path(out) / f"{split}.parquet") for split, rows in records.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.data.preprocess.gsm8k", description=__doc__)
    parser.add_argument("--input", default=None, help="folder (or file) with the original GSM8K train/test data")
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    args = parser.parse_args(argv)
    try:
        written = preprocess(args.input, args.out)
    except (RuntimeError, FileNotFoundError, ValueError) as error:
        parser.exit(1, f"error: {error}\n")
    for split, path in written.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
