"""Data-file rows to token rows with a loss mask, and token rows to a batch in the RL step's layout.

Shared by the supervised data sets: SFT's (one sample per conversation turn run, data/sft_dataset.py) and the
preference pairs' (a chosen and a rejected answer per row, data/preference_dataset.py). A row holds a conversation
(chat messages, the assistant turns trained), or a prompt (chat messages or text) with an answer (text, all of it
trained); rendering goes through the model's chat template and the loss mask through data/chat_mask.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.batch_keys import ATTENTION_MASK, INDEX, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from hybridflow.data.chat_mask import TRAIN_KEY, TextSample, conversation_samples, tokenize_sample
from hybridflow.protocol import DataProto

PROMPT_IDS, RESPONSE_IDS, LOSS_MASK = "prompt_ids", "response_ids", "loss_mask"


def end_texts(tokenizer: Any, generation_eos: int | list[int] | None = None) -> list[str]:
    """The texts of the tokens that end an assistant turn: the tokenizer's EOS and the model's generation EOS."""
    ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    texts = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    return list(dict.fromkeys([*(t for t in texts if t), *([tokenizer.eos_token] if tokenizer.eos_token else [])]))


def is_messages(value: Any) -> bool:
    """A non-empty list of chat messages (dicts with a string ``role``)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


def clean_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the template expects it: parquet gives absent keys as None."""
    return {key: value for key, value in message.items() if value is not None}


class OverlongSample(ValueError):
    """A sample longer than ``max_length`` tokens with ``overlong=error``: the caller names its file and row."""

    def __init__(self, length: int) -> None:
        super().__init__(f"{length} tokens")
        self.length = length


@dataclass(frozen=True)
class Encoded:
    """A sample's token row (``PROMPT_IDS``, ``RESPONSE_IDS``, ``LOSS_MASK``), or None when nothing is left to
    train on; and whether it was cut at ``max_length``."""

    row: dict[str, list[int]] | None
    truncated: bool = False


class SampleEncoder:
    """Rows to text samples through the chat template, and text samples to token rows within ``max_length``."""

    def __init__(
        self, tokenizer: Any, *, max_length: int, overlong: str, generation_eos: int | list[int] | None = None
    ):
        """max_length, overlong: the data set's settings (``data.max_length``, ``data.overlong``)."""
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.overlong = overlong
        self.end_texts = end_texts(tokenizer, generation_eos)

    def render(self, tools: list[dict] | None):
        def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            extra = {"tools": tools} if tools else {}
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )

        return render

    def conversation(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[TextSample]:
        """A conversation's samples: its assistant turns trained (those not marked ``"train": false``)."""
        return conversation_samples([clean_message(m) for m in messages], self.render(tools), self.end_texts)

    def answer(self, prompt: Any, answer: str, tools: list[dict] | None, prompt_column: str) -> list[TextSample]:
        """A prompt (chat messages or text, from ``prompt_column``) with its answer, all of the answer trained."""
        if is_messages(prompt):  # a chat prompt: the answer is its assistant turn, as the template writes it
            context = [{**clean_message(m), TRAIN_KEY: False} for m in prompt]  # a few-shot example is prompt
            return self.conversation([*context, {"role": "assistant", "content": answer}], tools)
        if not isinstance(prompt, str):
            raise ValueError(f"column {prompt_column!r} is neither chat messages nor text: {prompt!r:.120}")
        ending = "" if any(answer.endswith(end) for end in self.end_texts) else self.end_texts[0]
        return [TextSample([(prompt, False), (answer + ending, True)])]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def encode(self, sample: TextSample) -> Encoded:
        """The sample's token row, cut or refused at ``max_length`` as ``overlong`` says (OverlongSample for
        ``error``)."""
        limit, overlong = self.max_length, self.overlong
        ids, mask = tokenize_sample(sample, self._encode)
        truncated = False
        if len(ids) > limit:
            if overlong == "error":
                raise OverlongSample(len(ids))
            if overlong == "drop" or not any(mask[:limit]):
                return Encoded(None)
            ids, mask, truncated = ids[:limit], mask[:limit], True
        if not any(mask):
            return Encoded(None)  # a turn of only an end token cut off by a template: nothing to learn
        # the untrained context before the first trained token is the prompt; a first token has nothing to be
        # predicted from, so it is context even where it is trained (a plain-text prompt of "")
        first = max(mask.index(1), 1)
        if not any(mask[first:]):
            return Encoded(None)
        return Encoded({PROMPT_IDS: ids[:first], RESPONSE_IDS: ids[first:], LOSS_MASK: mask[first:]}, truncated)


def collate_rows(rows: Sequence[dict[str, Any]], pad_token_id: int) -> DataProto:
    """Token rows as a DataProto in the RL step's layout: ``input_ids``, ``attention_mask``, ``position_ids``
    (B, P+R) with the prompts left-padded to the batch's longest and the responses right-padded; ``responses`` and
    ``response_mask`` (B, R), 1 on the trained tokens; ``index`` (each row's row in its files)."""
    if not rows:
        raise ValueError("collate needs at least one row")
    prompt_width = max(1, max(len(row[PROMPT_IDS]) for row in rows))  # the engine's passes need a prompt column
    response_width = max(len(row[RESPONSE_IDS]) for row in rows)
    batch = len(rows)
    input_ids = torch.full((batch, prompt_width + response_width), pad_token_id, dtype=torch.long)
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


def next_token_row(row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """A token row as next-token prediction, the Tinker API's datum shape: (inputs, targets, mask), each of the
    sequence's length minus one; ``mask[i]`` is whether ``targets[i]`` is a trained token."""
    tokens = [*row[PROMPT_IDS], *row[RESPONSE_IDS]]
    mask = [0] * len(row[PROMPT_IDS]) + list(row[LOSS_MASK])
    return tokens[:-1], tokens[1:], mask[1:]


def token_mean_batch(rows: Sequence[dict[str, Any]]) -> list[tuple[list[int], list[int], np.ndarray]]:
    """A batch of token rows as next-token datums (``next_token_row``) whose float32 weights are the trained-token
    mask over the batch's trained tokens: the summed loss a Tinker-API client sends is the SFT trainer's token mean."""
    shifted = [next_token_row(row) for row in rows]
    trained = sum(sum(mask) for _, _, mask in shifted)
    return [(inputs, targets, np.asarray(mask, dtype=np.float32) / trained) for inputs, targets, mask in shifted]
