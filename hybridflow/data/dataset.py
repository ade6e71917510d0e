"""RLHFDataset: prompt rows from parquet/jsonl, chat-templated and tokenized once, up front.

Each row has `prompt` (chat messages), `data_source`, `reward_model` ({"ground_truth": ...,
"style": "rule"}) and optionally `extra_info` (a dict; multi-turn rows may give their tools' arguments
under `extra_info.tools_kwargs`) and `agent_name` (multi-turn: the row's agent loop). Tokenizing everything at load time
makes the length filter exact (it sees the templated prompt, system prompt included) and
keeps `__getitem__` and the per-step `collate` cheap.

`collate` left-pads to the longest prompt *of the batch*, not to `max_prompt_length`:
prompts vary in length, so a fixed width would make the rollout and every log-prob pass
work on pad tokens; a fixed shape would only help compiled graphs, which nothing here uses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.batch_keys import (
    AGENT_NAME,
    ATTENTION_MASK,
    DATA_SOURCE,
    EXTRA_INFO,
    INDEX,
    INPUT_IDS,
    POSITION_IDS,
    RAW_PROMPT,
    REWARD_MODEL,
)
from hybridflow.data.config import DatasetConfig
from hybridflow.data.io import data_files, rows_of_files
from hybridflow.protocol import DataProto
from hybridflow.validation import ConfigError, InputFileError

logger = logging.getLogger(__name__)

NON_TENSOR_KEYS = (DATA_SOURCE, REWARD_MODEL, EXTRA_INFO, RAW_PROMPT, INDEX, AGENT_NAME)


def _object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-d object array holding each value as is (numpy would turn nested lists into 2-d)."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def _messages(row: dict, key: str) -> list[dict] | None:
    """The row's chat messages in column ``key``, or None when they are not a list of role/content dicts."""
    messages = row.get(key)
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    return [{"role": m["role"], "content": m["content"]} for m in messages] if ok else None


FORMAT_HINT = "rows as python -m hybridflow.data.tasks writes them (docs: RLHFDataset)"


def read_prompt_rows(
    files: str | Path | Sequence[str | Path], config: DatasetConfig, key: str = "data.train_files"
) -> tuple[list[dict[str, Any]], list[list[dict[str, str]]]]:
    """Every row of ``files`` and its chat messages, each row checked for its prompt and reward columns (no
    tokenizer needed: a run checks its rows with this before it builds a model). InputFileError naming the file,
    the row and ``key`` for a row without them."""
    rows, messages = [], []
    for file, index, row in rows_of_files(data_files(files, key), key, FORMAT_HINT):
        chat = _messages(row, config.prompt_key)
        if chat is None:
            raise InputFileError(
                file,
                f"row {index}: column {config.prompt_key!r} (data.prompt_key) is not a non-empty list of "
                f'{{"role": str, "content": str}} messages: {row.get(config.prompt_key)!r:.120}',
                f"set data.prompt_key to the column with the chat messages; the columns are {sorted(row)}",
                key,
            )
        for column in (DATA_SOURCE, REWARD_MODEL):
            if column not in row:
                raise InputFileError(
                    file, f"row {index} has no {column!r} column; its columns: {sorted(row)}", FORMAT_HINT, key
                )
        rows.append(row)
        messages.append(chat)
    return rows, messages


class RLHFDataset:
    """Chat prompts with their reward information, ready to collate into DataProto batches."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        config: DatasetConfig,
        tools: list[dict[str, Any]] | None = None,
        *,
        key: str = "data.train_files",
    ) -> None:
        """tools: the OpenAI function schemas of a multi-turn run's tools, given to the chat template (templates
        that know tools list them in the prompt; others ignore them). key: the setting that named ``files``
        (errors name it and the file)."""
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; collate needs one to left-pad prompts")
        self.tokenizer = tokenizer
        self.config = config
        self.files = data_files(files, key)
        rows, messages = read_prompt_rows(self.files, config, key)
        tool_kwargs = {"tools": tools} if tools else {}
        texts = [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **tool_kwargs)
            for m in messages
        ]
        # the template already holds every special token; the tokenizer must not add a BOS
        token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        self.rows = self._keep_short(rows, messages, token_ids)

    def _keep_short(self, rows: list[dict], messages: list[list[dict]], token_ids: list[list[int]]) -> list[dict]:
        limit = self.config.max_prompt_length
        kept = []
        for index, (row, chat, ids) in enumerate(zip(rows, messages, token_ids, strict=True)):
            if len(ids) > limit:
                if not self.config.filter_overlong_prompts:
                    raise ConfigError(
                        "data.max_prompt_length",
                        f"row {index} of {[str(f) for f in self.files]} has a templated prompt of {len(ids)} tokens, "
                        f"longer than {limit}",
                        "raise data.max_prompt_length, or set data.filter_overlong_prompts=true to drop such rows",
                    )
                continue
            kept.append(
                {
                    INPUT_IDS: ids,
                    RAW_PROMPT: chat,
                    DATA_SOURCE: row[DATA_SOURCE],
                    REWARD_MODEL: row[REWARD_MODEL],
                    EXTRA_INFO: row.get(EXTRA_INFO) or {},
                    INDEX: index,  # the row's position in the files, stable under filtering
                    AGENT_NAME: str(row.get(AGENT_NAME) or ""),  # multi-turn: the row's agent loop ("": the default)
                }
            )
        if not kept:
            shortest = min(len(ids) for ids in token_ids)
            raise ConfigError(
                "data.max_prompt_length",
                f"every prompt of {[str(f) for f in self.files]} is longer than {limit} tokens once templated "
                f"(the shortest has {shortest})",
                f"raise it to at least {shortest}",
            )
        dropped = len(rows) - len(kept)
        if dropped:
            logger.warning(
                "dropped %d of %d rows whose templated prompt is longer than data.max_prompt_length=%d tokens",
                dropped,
                len(rows),
                limit,
            )
        return kept

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One row: `input_ids` (list of ints), `raw_prompt`, `data_source`, `reward_model`, `extra_info`, `index`,
        `agent_name`."""
        return self.rows[i]

    def collate(self, rows: Sequence[dict[str, Any]]) -> DataProto:
        """Left-pad the rows' prompts to the batch's longest into a DataProto.

        Tensors (B, P), int64: `input_ids`, `attention_mask` (1 on prompt tokens),
        `position_ids` (0, 1, ... from the first real token; 0 on padding).
        """
        if not rows:
            raise ValueError("collate needs at least one row")
        width = max(len(row[INPUT_IDS]) for row in rows)
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)  # (B, P)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, P)
        for i, row in enumerate(rows):
            ids = row[INPUT_IDS]
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids) :] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
        return DataProto.from_dict(
            tensors={INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask, POSITION_IDS: position_ids},
            non_tensors={key: _object_array([row[key] for row in rows]) for key in NON_TENSOR_KEYS},
        )
