"""RewardPairDataset: preference pairs as the reward model reads them, for Bradley-Terry training (``hybridflow rm``).

Rows are PreferenceDataset's (a prompt with a chosen and a rejected answer, or two conversations sharing their first
messages; data/preference_dataset.py). Each answer becomes the text an RL run's reward worker would score
(data/reward_text.py): the conversation through the reward model's chat template, tokenised whole. So a model
trained on these rows scores a policy's answers in an RL run exactly as it scored them here.

Rows 2k and 2k+1 are pair k, chosen first. The two answers' shared first tokens are the row's "prompt" and the rest
its "response" (the RL step's layout, data/token_rows.py): a packed pass computes the shared part once for both,
and micro-batches keep a pair together. A text longer than ``data.max_length`` loses its first tokens under
``overlong=truncate``, as the reward worker's tokenizer cuts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jinja2.exceptions import TemplateError

from hybridflow.batch_keys import INDEX, PAIR_MARGIN
from hybridflow.data.config import PreferenceDatasetConfig
from hybridflow.data.io import data_files, rows_of_files
from hybridflow.data.preference_dataset import (
    CHOSEN,
    FORMAT_HINT,
    MARGIN,
    REJECTED,
    check_pairs_left,
    pair_margin,
    pair_parts,
)
from hybridflow.data.reward_text import reward_model_ids, reward_model_text, scored_conversation
from hybridflow.data.token_rows import LOSS_MASK, PROMPT_IDS, RESPONSE_IDS, collate_rows
from hybridflow.protocol import DataProto
from hybridflow.validation import ConfigError, InputFileError


def shared_tokens(first: list[int], second: list[int]) -> int:
    """How many tokens two sequences share from their start, leaving each at least one of its own."""
    limit = min(len(first), len(second)) - 1
    count = 0
    while count < limit and first[count] == second[count]:
        count += 1
    return count


class RewardPairDataset:
    """Pairs tokenised once, up front, by the reward model's tokenizer; ``collate`` makes batches of 2 rows per
    pair with ``pair_margin``."""

    unit = "pairs"  # what one item is, in messages

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        config: PreferenceDatasetConfig,
        *,
        generation_eos: int | list[int] | None = None,
        key: str = "data.train_files",
    ) -> None:
        """tokenizer: the reward model's. generation_eos: unused (a scored text ends where its template ends).
        key: the setting that named ``files`` (errors name it, the file and the row)."""
        del generation_eos
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; collate needs one")
        self.tokenizer = tokenizer
        self.config = config
        self.files = data_files(files, key)
        self.pairs: list[dict[str, Any]] = []
        dropped = truncated = total = 0
        for row_number, (file, index, row) in enumerate(rows_of_files(self.files, key, FORMAT_HINT)):
            total += 1
            try:
                prompt, chosen, rejected = pair_parts(row, config)
                margin = pair_margin(row, config.margin_key)
                ids = [self._ids(prompt, answer) for answer in (chosen, rejected)]
            except (TemplateError, ValueError) as error:
                raise InputFileError(file, f"row {index}: {error}", f"give {FORMAT_HINT}", key) from None
            longest = max(len(i) for i in ids)
            if longest > config.max_length:
                if config.overlong == "error":
                    raise ConfigError(
                        "data.max_length",
                        f"row {index} of {file}: an answer is {longest} tokens long once templated, longer than "
                        f"{config.max_length}",
                        "raise data.max_length, or set data.overlong=drop (skip such pairs) or truncate (keep the "
                        "last tokens, as the RL reward worker does)",
                    )
                if config.overlong == "drop":
                    dropped += 1
                    continue
                truncated += sum(len(i) > config.max_length for i in ids)
                ids = [i[-config.max_length :] for i in ids]
            shared = shared_tokens(*ids)
            chosen_row, rejected_row = (
                {
                    PROMPT_IDS: i[:shared],
                    RESPONSE_IDS: i[shared:],
                    LOSS_MASK: [1] * (len(i) - shared),
                    INDEX: row_number,
                }
                for i in ids
            )
            self.pairs.append({CHOSEN: chosen_row, REJECTED: rejected_row, MARGIN: margin})
        check_pairs_left(self.pairs, self.files, config, dropped=dropped, truncated=truncated, total=total)

    def _ids(self, prompt: Any, answer: Any) -> list[int]:
        if not isinstance(prompt, str) and not isinstance(answer, str):
            if not any(m.get("role") == "assistant" for m in answer):
                raise ValueError("an answer has no assistant message (it is all of the shared prompt?)")
        text = reward_model_text(self.tokenizer, scored_conversation(prompt, answer))
        return reward_model_ids(self.tokenizer, text)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One pair: ``chosen`` and ``rejected`` token rows (``prompt_ids``: the tokens the two share,
        ``response_ids``: the rest, ``loss_mask``, ``index``), and its ``margin``."""
        return self.pairs[i]

    def trained_tokens(self) -> int:
        """Tokens the model reads, both answers of every pair (it is scored at each answer's last one)."""
        return sum(
            len(pair[s][PROMPT_IDS]) + len(pair[s][RESPONSE_IDS]) for pair in self.pairs for s in (CHOSEN, REJECTED)
        )

    def collate(self, pairs: Sequence[dict[str, Any]]) -> DataProto:
        """2P rows, pair k's chosen answer at row 2k and its rejected one at 2k+1 (``token_rows.collate_rows``), with
        ``pair_margin`` (2P,) on both rows of a pair."""
        rows = [pair[side] for pair in pairs for side in (CHOSEN, REJECTED)]
        batch = collate_rows(rows, self.tokenizer.pad_token_id)
        batch.batch[PAIR_MARGIN] = torch.tensor([pair[MARGIN] for pair in pairs for _ in range(2)], dtype=torch.float32)
        return batch
