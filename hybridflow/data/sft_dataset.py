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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jinja2.exceptions import TemplateError

from hybridflow.batch_keys import ATTENTION_MASK, INDEX, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from hybridflow.data.chat_mask import TRAIN_KEY, ChatMaskError, TextSample, conversation_samples, tokenize_sample
from hybridflow.data.config import SFTDatasetConfig
from hybridflow.data.io import data_files, rows_of_files
from hybridflow.protocol import DataProto
from hybridflow.validation import ConfigError, InputFileError

logger = logging.getLogger(__name__)

PROMPT_IDS, RESPONSE_IDS, LOSS_MASK = "prompt_ids", "response_ids", "loss_mask"
FORMAT_HINT = (
    'rows with a "messages" column [{"role": ..., "content": ...}, ...] (data.messages_key), or "prompt" and '
    '"response" columns (data.prompt_key, data.response_key)'
)


def end_texts(tokenizer: Any, generation_eos: int | list[int] | None = None) -> list[str]:
    """The texts of the tokens that end an assistant turn: the tokenizer's EOS and the model's generation EOS."""
    ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    texts = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    return list(dict.fromkeys([*(t for t in texts if t), *([tokenizer.eos_token] if tokenizer.eos_token else [])]))


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the template expects it: parquet gives absent keys as None."""
    return {key: value for key, value in message.items() if value is not None}


class SFTDataset:
    """Token sequences with their loss masks, tokenised once, up front; ``collate`` makes DataProto batches."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        config: SFTDatasetConfig,
        *,
        generation_eos: int | list[int] | None = None,
        key: str = "data.train_files",
    ) -> None:
        """generation_eos: the model's generation EOS (its generation_config), a stop token besides the tokenizer's.
        key: the setting that named ``files`` (errors name it and the file)."""
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; collate needs one")
        self.tokenizer = tokenizer
        self.config = config
        self.end_texts = end_texts(tokenizer, generation_eos)
        self.files = data_files(files, key)
        samples: list[tuple[int, TextSample]] = []  # (row number over all files, sample)
        for row_number, (file, index, row) in enumerate(rows_of_files(self.files, key, FORMAT_HINT)):
            try:
                samples += [(row_number, sample) for sample in self._samples(row)]
            except (ChatMaskError, TemplateError, ValueError) as error:
                raise InputFileError(file, f"row {index}: {error}", f"give {FORMAT_HINT}", key) from None
        self.rows = self._tokenize(samples)

    # ---- rows -> text samples ----------------------------------------------------------------

    def _render(self, tools: list[dict] | None):
        def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            extra = {"tools": tools} if tools else {}
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )

        return render

    def _samples(self, row: dict[str, Any]) -> list[TextSample]:
        cfg = self.config
        tools = row.get(cfg.tools_key) if cfg.tools_key else None
        messages = row.get(cfg.messages_key) if cfg.messages_key else None
        if messages is not None:
            if not _is_messages(messages):
                raise ValueError(f"column {cfg.messages_key!r} is not a list of chat messages: {messages!r:.120}")
            return conversation_samples([_clean(m) for m in messages], self._render(tools), self.end_texts)
        prompt, response = row.get(cfg.prompt_key), row.get(cfg.response_key)
        if prompt is None or not isinstance(response, str):
            raise ValueError(
                f"neither a {cfg.messages_key!r} column nor {cfg.prompt_key!r} and {cfg.response_key!r} (text) "
                f"columns; its columns: {sorted(row)}"
            )
        if _is_messages(prompt):  # a chat prompt: the answer is its assistant turn, as the template writes it
            context = [{**_clean(m), TRAIN_KEY: False} for m in prompt]  # a few-shot example's turns are prompt
            conversation = [*context, {"role": "assistant", "content": response}]
            return conversation_samples(conversation, self._render(tools), self.end_texts)
        if not isinstance(prompt, str):
            raise ValueError(f"column {cfg.prompt_key!r} is neither chat messages nor text: {prompt!r:.120}")
        ending = "" if any(response.endswith(end) for end in self.end_texts) else self.end_texts[0]
        return [TextSample([(prompt, False), (response + ending, True)])]

    # ---- text samples -> token rows -----------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _tokenize(self, samples: list[tuple[int, TextSample]]) -> list[dict[str, Any]]:
        limit, overlong = self.config.max_length, self.config.overlong
        rows, dropped, truncated = [], 0, 0
        for row_number, sample in samples:
            ids, mask = tokenize_sample(sample, self._encode)
            if len(ids) > limit:
                if overlong == "error":
                    raise ConfigError(
                        "data.max_length",
                        f"row {row_number} of {[str(f) for f in self.files]} is {len(ids)} tokens long once "
                        f"templated, longer than {limit}",
                        "raise data.max_length, or set data.overlong=drop (skip such samples) or truncate (cut "
                        "them at the limit)",
                    )
                if overlong == "drop" or not any(mask[:limit]):
                    dropped += 1
                    continue
                ids, mask, truncated = ids[:limit], mask[:limit], truncated + 1
            if not any(mask):
                dropped += 1  # a turn of only an end token cut off by a template: nothing to learn
                continue
            # the untrained context before the first trained token is the prompt; a first token has nothing to be
            # predicted from, so it is context even where it is trained (a plain-text prompt of "")
            first = max(mask.index(1), 1)
            if not any(mask[first:]):
                dropped += 1
                continue
            rows.append(
                {PROMPT_IDS: ids[:first], RESPONSE_IDS: ids[first:], LOSS_MASK: mask[first:], INDEX: row_number}
            )
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

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One sample: ``prompt_ids``, ``response_ids``, ``loss_mask`` (lists of ints), ``index`` (its row)."""
        return self.rows[i]

    def trained_tokens(self) -> int:
        """Tokens the loss covers, over the whole dataset."""
        return sum(sum(row[LOSS_MASK]) for row in self.rows)

    def collate(self, rows: Sequence[dict[str, Any]]) -> DataProto:
        """The rows as a DataProto in the RL step's layout: ``input_ids``, ``attention_mask``, ``position_ids``
        (B, P+R) with the prompts left-padded to the batch's longest and the responses right-padded;
        ``responses`` and ``response_mask`` (B, R), 1 on the trained tokens."""
        if not rows:
            raise ValueError("collate needs at least one row")
        pad = self.tokenizer.pad_token_id
        prompt_width = max(1, max(len(row[PROMPT_IDS]) for row in rows))  # the engine's passes need a prompt column
        response_width = max(len(row[RESPONSE_IDS]) for row in rows)
        batch = len(rows)
        input_ids = torch.full((batch, prompt_width + response_width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        response_mask = torch.zeros((batch, response_width), dtype=torch.long)
        for i, row in enumerate(rows):
            prompt, response = row[PROMPT_IDS], row[RESPONSE_IDS]
            start, end = prompt_width - len(prompt), prompt_width + len(response)
            input_ids[i, start:end] = torch.tensor(prompt + response, dtype=torch.long)
            attention_mask[i, start:end] = 1
            response_mask[i, : len(response)] = torch.tensor(row[LOSS_MASK], dtype=torch.long)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        index = np.array([row[INDEX] for row in rows], dtype=object)
        return DataProto.from_dict(
            tensors={
                INPUT_IDS: input_ids,
                ATTENTION_MASK: attention_mask,
                POSITION_IDS: position_ids,
                RESPONSES: input_ids[:, prompt_width:],
                RESPONSE_MASK: response_mask,
            },
            non_tensors={INDEX: index},
        )
