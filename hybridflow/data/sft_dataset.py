"""SFTDataset: conversations (or prompt/response pairs) from parquet/jsonl as token sequences with a loss mask.

A row holds either a conversation in column ``data.messages_key`` (system/user/assistant/tool messages; an
assistant message may carry ``tool_calls``, and a row may give its tools' schemas in ``data.tools_key`` for the
template), or a prompt in ``data.prompt_key`` (chat messages, or plain text) with its answer in
``data.response_key``. Conversations are rendered with the model's chat template and the loss covers the
assistant turns only (data/chat_mask.py); an answer to a plain-text prompt gets the end-of-turn token appended.

Batches come in the layout of an RL step's, so that every pass of the engine (packing, micro-batches by token
count, tensor parallelism) serves SFT unchanged: the untrained context before the first assistant turn is the
"prompt" (left-padded), the rest the "response" (right-padded), and ``response_mask`` is 1 on the trained
tokens (later user and tool messages are 0 in it, as tool output is in a multi-turn rollout).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jinja2.exceptions import TemplateError

from hybridflow.batch_keys import INDEX
from hybridflow.data.chat_mask import ChatMaskError, TextSample
from hybridflow.data.config import SFTDatasetConfig
from hybridflow.data.file_dataset import FileDataset
from hybridflow.data.io import rows_of_files
from hybridflow.data.token_rows import (
    LOSS_MASK,
    PROMPT_IDS,
    RESPONSE_IDS,
    OverlongSample,
    collate_rows,
    is_messages,
)
from hybridflow.protocol import DataProto
from hybridflow.validation import ConfigError, InputFileError

logger = logging.getLogger(__name__)

__all__ = ["FORMAT_HINT", "LOSS_MASK", "PROMPT_IDS", "RESPONSE_IDS", "SFTDataset"]

FORMAT_HINT = (
    'rows with a "messages" column [{"role": ..., "content": ...}, ...] (data.messages_key), or "prompt" and '
    '"response" columns (data.prompt_key, data.response_key)'
)


class SFTDataset(FileDataset[SFTDatasetConfig]):
    """Token sequences with their loss masks, tokenised once, up front; ``collate`` makes DataProto batches."""

    def _load(self, key: str, generation_eos: int | list[int] | None) -> None:
        self.encoder = self.sample_encoder(generation_eos)
        samples: list[tuple[int, TextSample]] = []  # (row number over all files, sample)
        for row_number, (file, index, row) in enumerate(rows_of_files(self.files, key, FORMAT_HINT)):
            try:
                samples += [(row_number, sample) for sample in self._samples(row)]
            except (ChatMaskError, TemplateError, ValueError) as error:
                raise InputFileError(file, f"row {index}: {error}", f"give {FORMAT_HINT}", key) from None
        self.rows = self._tokenize(samples)

    def _samples(self, row: dict[str, Any]) -> list[TextSample]:
        cfg = self.config
        tools = row.get(cfg.tools_key) if cfg.tools_key else None
        messages = row.get(cfg.messages_key) if cfg.messages_key else None
        if messages is not None:
            if not is_messages(messages):
                raise ValueError(f"column {cfg.messages_key!r} is not a list of chat messages: {messages!r:.120}")
            return self.encoder.conversation(messages, tools)
        prompt, response = row.get(cfg.prompt_key), row.get(cfg.response_key)
        if prompt is None or not isinstance(response, str):
            raise ValueError(
                f"neither a {cfg.messages_key!r} column nor {cfg.prompt_key!r} and {cfg.response_key!r} (text) "
                f"columns; its columns: {sorted(row)}"
            )
        return self.encoder.answer(prompt, response, tools, cfg.prompt_key)

    def _tokenize(self, samples: list[tuple[int, TextSample]]) -> list[dict[str, Any]]:
        limit, overlong = self.config.max_length, self.config.overlong
        rows, dropped, truncated = [], 0, 0
        for row_number, sample in samples:
            try:
                encoded = self.encoder.encode(sample)
            except OverlongSample as error:
                raise ConfigError(
                    "data.max_length",
                    f"row {row_number} of {[str(f) for f in self.files]} is {error.length} tokens long once "
                    f"templated, longer than {limit}",
                    "raise data.max_length, or set data.overlong=drop (skip such samples) or truncate (cut "
                    "them at the limit)",
                ) from None
            if encoded.row is None:
                dropped += 1
                continue
            truncated += encoded.truncated
            rows.append({**encoded.row, INDEX: row_number})
        if dropped or truncated:
            logger.warning(
                "%d of %d samples dropped and %d truncated at data.max_length=%d tokens (data.overlong=%s)",
                dropped,
                len(samples),
                truncated,
                limit,
                overlong,
            )
        if not rows:
            raise ConfigError(
                "data.max_length", f"no sample of {[str(f) for f in self.files]} is left to train on", "raise it"
            )
        return rows

    unit = "samples"  # what one item is, in messages

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One sample: ``prompt_ids``, ``response_ids``, ``loss_mask`` (lists of ints), ``index`` (its row)."""
        return self.rows[i]

    def trained_tokens(self) -> int:
        """Tokens the loss covers, over the whole dataset."""
        return sum(sum(row[LOSS_MASK]) for row in self.rows)

    def collate(self, rows: Sequence[dict[str, Any]]) -> DataProto:
        """The rows as a DataProto in the RL step's layout (``token_rows.collate_rows``)."""
        return collate_rows(rows, self.tokenizer.pad_token_id)
