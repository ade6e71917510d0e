"""Reading and writing dataset rows: parquet or jsonl, one dict per row.

Rows come back as plain Python values (lists and dicts, never numpy arrays), whichever
format they were stored in, so a chat `prompt` is a list of {"role", "content"} dicts.
Parquet stores dict columns as structs: keys that some rows lack read back as None.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.validation import ConfigError, InputFileError, reading_file

FORMATS = (".parquet", ".jsonl", ".json")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of one .parquet or .jsonl file (.json is read as JSON lines too)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise ValueError(f"{path}:{line_number} is not a JSON object: {error}") from None
        return rows
    raise ValueError(f"data file {str(path)!r} has an unknown format; expected one of {FORMATS}")


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to `path` (.parquet or .jsonl, by suffix), creating the folder."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    else:
        raise ValueError(f"cannot write {str(path)!r}: the suffix must be .parquet or .jsonl")
    return path


def data_files(files: str | Path | Sequence[str | Path], key: str) -> list[Path]:
    """The files a dataset setting (``key``) names, as paths; ConfigError when it names none."""
    paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    if not paths:
        raise ConfigError(key, "no data files given", "give parquet or jsonl files")
    return paths


def rows_of_files(files: list[Path], key: str, hint: str) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(file, index in the file, row) of every row of ``files``, in order. A file that cannot be read, or that holds
    no rows, is an InputFileError naming it and the setting ``key``; ``hint`` says what rows to give."""
    for file in files:
        with reading_file(file, key=key, fix=f"give parquet or jsonl files of {hint}"):
            file_rows = read_rows(file)
        if not file_rows:
            raise InputFileError(file, "holds no rows", f"give {hint}", key)
        for index, row in enumerate(file_rows):
            yield file, index, row
