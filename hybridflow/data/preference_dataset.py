"""PreferenceDataset: pairs of a chosen and a rejected answer to one prompt, as token rows with loss masks.

A row gives the prompt and the two answers in one of two forms:

- a prompt in ``data.prompt_key`` (chat messages, or plain text) and each answer in ``data.chosen_key`` and
  ``data.rejected_key``: text (the assistant's reply), or the messages that follow the prompt (assistant turns, and
  tool messages between them);
- no prompt column: each answer is a whole conversation, and the messages the two share from the start are the
  prompt; what follows is the answer.

Each answer is rendered with the model's chat template as SFT renders a conversation (data/chat_mask.py), so its
loss mask covers the assistant's tokens only; the prompt and tool messages are context. An answer must come out as
one sequence: a template that re-renders the history between turns is refused here, naming the row.

Batches interleave the pairs, chosen first: rows 2k and 2k+1 are pair k (``algorithms/preference.py pair_halves``),
in the RL step's layout (data/token_rows.py), so every pass of the engine serves them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from jinja2.exceptions import TemplateError

from hybridflow.batch_keys import INDEX, PAIR_MARGIN
from hybridflow.data.chat_mask import TRAIN_KEY, ChatMaskError, TextSample
from hybridflow.data.config import PreferenceDatasetConfig
from hybridflow.data.file_dataset import FileDataset
from hybridflow.data.io import rows_of_files
from hybridflow.data.token_rows import LOSS_MASK, OverlongSample, collate_rows, is_messages
from hybridflow.protocol import DataProto
from hybridflow.validation import ConfigError, InputFileError

logger = logging.getLogger(__name__)

CHOSEN, REJECTED, MARGIN = "chosen", "rejected", "margin"
FORMAT_HINT = (
    'rows with a "prompt" (chat messages or text) and "chosen" and "rejected" answers (text, or the messages '
    'after the prompt), or "chosen" and "rejected" conversations that share their first messages '
    "(data.prompt_key, data.chosen_key, data.rejected_key)"
)


def shared_prefix(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> int:
    """How many messages two conversations share from their start."""
    count = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        count += 1
    return count


def pair_parts(row: dict[str, Any], cfg: PreferenceDatasetConfig) -> tuple[Any, Any, Any]:
    """A row's prompt (chat messages or text) and its chosen and rejected answers (text, or the messages after the
    prompt); ValueError naming what is wrong with the row."""
    chosen, rejected = row.get(cfg.chosen_key), row.get(cfg.rejected_key)
    for column, answer in ((cfg.chosen_key, chosen), (cfg.rejected_key, rejected)):
        if not (isinstance(answer, str) or is_messages(answer)):
            raise ValueError(
                f"column {column!r} is neither text nor chat messages: {answer!r:.120}; its columns: {sorted(row)}"
            )
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError(f"one of {cfg.chosen_key!r} and {cfg.rejected_key!r} is text and the other messages")
    prompt = row.get(cfg.prompt_key) if cfg.prompt_key else None
    if prompt is None:
        if isinstance(chosen, str):
            raise ValueError(
                f"the answers are text but the row has no prompt column {cfg.prompt_key!r}; its columns: {sorted(row)}"
            )
        shared = shared_prefix(chosen, rejected)
        if shared == 0:
            raise ValueError("the chosen and rejected conversations share no first message to be the prompt")
        return chosen[:shared], chosen[shared:], rejected[shared:]
    return prompt, chosen, rejected


def pair_margin(row: dict[str, Any], margin_key: str) -> float:
    """The row's number in ``margin_key`` (0 without one); ValueError when it is not a number."""
    if not margin_key:
        return 0.0
    value = row.get(margin_key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"column {margin_key!r} (data.margin_key) is not a number: {value!r:.60}")
    return float(value)


def check_pairs_left(
    pairs: list, files: list[Path], config: PreferenceDatasetConfig, *, dropped: int, truncated: int, total: int
) -> None:
    """Log how many pairs ``data.overlong`` dropped and answers it cut; ConfigError when no pair is left."""
    if dropped or truncated:
        logger.warning(
            "%d of %d pairs dropped and %d answers truncated at data.max_length=%d tokens (data.overlong=%s)",
            dropped,
            total,
            truncated,
            config.max_length,
            config.overlong,
        )
    if not pairs:
        raise ConfigError("data.max_length", f"no pair of {[str(f) for f in files]} is left to train on", "raise it")


class PairDataset(FileDataset[PreferenceDatasetConfig]):
    """Pairs of token rows, a chosen and a rejected answer each, tokenised once, up front; ``collate`` makes DataProto
    batches of 2 rows per pair."""

    unit = "pairs"  # what one item is, in messages
    truncation: ClassVar[str]  # what data.overlong=truncate does to a long answer (the overlong error suggests it)

    def _load(self, key: str, generation_eos: int | list[int] | None) -> None:
        config = self.config
        self.pairs: list[dict[str, Any]] = []
        dropped = truncated = total = 0
        for row_number, (file, index, row) in enumerate(rows_of_files(self.files, key, FORMAT_HINT)):
            total += 1
            try:
                pair, cut = self._pair(row, row_number)
            except OverlongSample as error:
                raise ConfigError(
                    "data.max_length",
                    f"row {index} of {file}: an answer is {error.length} tokens long once templated, longer than "
                    f"{config.max_length}",
                    "raise data.max_length, or set data.overlong=drop (skip such pairs) or truncate "
                    f"({self.truncation})",
                ) from None
            except (ChatMaskError, TemplateError, ValueError) as error:
                raise InputFileError(file, f"row {index}: {error}", f"give {FORMAT_HINT}", key) from None
            if pair is None:
                dropped += 1
                continue
            truncated += cut
            self.pairs.append(pair)
        check_pairs_left(self.pairs, self.files, config, dropped=dropped, truncated=truncated, total=total)

    def _pair(self, row: dict[str, Any], row_number: int) -> tuple[dict[str, Any] | None, int]:
        """The pair of data row ``row_number`` (None: ``data.overlong=drop`` drops it) and how many of its answers
        were cut; ValueError naming what is wrong with the row, OverlongSample for an answer too long to keep."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One pair: ``chosen`` and ``rejected`` token rows (``prompt_ids``, ``response_ids``, ``loss_mask``,
        ``index``), and its ``margin``."""
        return self.pairs[i]

    def collate(self, pairs: Sequence[dict[str, Any]]) -> DataProto:
        """2P rows, pair k's chosen answer at row 2k and its rejected one at 2k+1, in the RL step's layout
        (``token_rows.collate_rows``), with ``pair_margin`` (2P,) on both rows of a pair."""
        rows = [pair[side] for pair in pairs for side in (CHOSEN, REJECTED)]
        batch = collate_rows(rows, self.tokenizer.pad_token_id)
        margins = torch.tensor([pair[MARGIN] for pair in pairs for _ in range(2)], dtype=torch.float32)
        batch.batch[PAIR_MARGIN] = margins
        return batch


class PreferenceDataset(PairDataset):
    """Pairs as the trained model reads them: each answer rendered with its chat template, its loss mask on the
    assistant's tokens."""

    truncation = "cut answers at the limit"

    def _load(self, key: str, generation_eos: int | list[int] | None) -> None:
        self.encoder = self.sample_encoder(generation_eos)
        super()._load(key, generation_eos)

    def _pair(self, row: dict[str, Any], row_number: int) -> tuple[dict[str, Any] | None, int]:
        chosen, rejected = self._samples(row)
        margin = pair_margin(row, self.config.margin_key)
        encoded = [self.encoder.encode(chosen), self.encoder.encode(rejected)]
        if any(e.row is None for e in encoded):
            return None, 0
        pair = {
            CHOSEN: {**encoded[0].row, INDEX: row_number},
            REJECTED: {**encoded[1].row, INDEX: row_number},
            MARGIN: margin,
        }
        return pair, sum(e.truncated for e in encoded)

    # ---- a row -> the two answers' text samples ----------------------------------------------

    def _samples(self, row: dict[str, Any]) -> tuple[TextSample, TextSample]:
        cfg = self.config
        tools = row.get(cfg.tools_key) if cfg.tools_key else None
        prompt, chosen, rejected = pair_parts(row, cfg)
        return (
            self._answer(prompt, chosen, tools, cfg.chosen_key),
            self._answer(prompt, rejected, tools, cfg.rejected_key),
        )

    def _answer(self, prompt: Any, answer: str | list[dict], tools: list[dict] | None, column: str) -> TextSample:
        if isinstance(answer, str):
            samples = self.encoder.answer(prompt, answer, tools, self.config.prompt_key)
        else:
            if not is_messages(prompt):
                raise ValueError(f"column {column!r} holds messages, so the prompt must be chat messages too")
            if not any(m.get("role") == "assistant" for m in answer):
                raise ValueError(f"the {column!r} answer has no assistant message (it is all of the shared prompt?)")
            context = [{**m, TRAIN_KEY: False} for m in prompt]
            samples = self.encoder.conversation([*context, *answer], tools)
        if len(samples) != 1:
            raise ValueError(
                f"the {column!r} answer renders as {len(samples)} sequences: the chat template rewrites earlier "
                "turns once later ones follow, so its turns cannot be scored as one answer; give one assistant turn "
                "per answer"
            )
        return samples[0]

    # ---- pairs -> batches -------------------------------------------------------------------

    def trained_tokens(self) -> int:
        """Answer tokens the loss covers, both answers of every pair."""
        return sum(sum(pair[side][LOSS_MASK]) for pair in self.pairs for side in (CHOSEN, REJECTED))
