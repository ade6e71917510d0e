"""Each training step's batch as a file (``trainer.rollout_data_dir``): what the model wrote and how it scored, and
the token ids and per-token numbers the update trained on, exactly.

``<dir>/step_<N>.jsonl`` holds one record per sample, in the batch's order:

    step, uid, data_source      the step, the prompt's group id (its n samples share it), the scorer's name
    prompt, response            the texts (special tokens kept, so that a chat template's markers show)
    score, reward               the scorer's score; the reward after the KL penalty where that is in the reward
    truncated                   the response holds no stop token (cut at the length budget)
    prompt_ids, response_ids    the real tokens, without padding
    response_mask               per response token: 1 where the losses train (generated tokens), 0 on tool output
    advantages, ...             per response token, each column the step computed: advantages, returns,
                                old_log_probs, rollout_log_probs, ref_log_prob, teacher_log_prob, values

The floats are the batch's float32 values written in full, so a step can be replayed token for token elsewhere (the
Tinker API service's equality test does so) or inspected. A resumed run writes its steps' files again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hybridflow.batch_keys import (
    ADVANTAGES,
    ATTENTION_MASK,
    DATA_SOURCE,
    INPUT_IDS,
    OLD_LOG_PROBS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RESPONSES,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    TEACHER_LOG_PROB,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    TRUNCATED,
    UID,
    VALUES,
)
from hybridflow.protocol import DataProto

PER_TOKEN = (ADVANTAGES, RETURNS, OLD_LOG_PROBS, ROLLOUT_LOG_PROBS, REF_LOG_PROB, TEACHER_LOG_PROB, VALUES)


def step_file(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step}.jsonl"


def batch_records(batch: DataProto, tokenizer: Any, step: int) -> list[dict[str, Any]]:
    """One record per row of a trained batch (the module's docstring lists the fields)."""
    tensors, objects = batch.batch, batch.non_tensor_batch
    prompt_width = tensors[INPUT_IDS].shape[1] - tensors[RESPONSES].shape[1]
    attention = tensors[ATTENTION_MASK].bool()
    columns = [key for key in PER_TOKEN if key in tensors.keys()]
    records = []
    for row in range(len(batch)):
        prompt_ids = tensors[INPUT_IDS][row, :prompt_width][attention[row, :prompt_width]].tolist()
        length = int(attention[row, prompt_width:].sum())  # responses are right-padded
        response_ids = tensors[RESPONSES][row, :length].tolist()
        record: dict[str, Any] = {
            "step": step,
            UID: str(objects[UID][row]) if UID in objects else None,
            DATA_SOURCE: str(objects[DATA_SOURCE][row]) if DATA_SOURCE in objects else None,
            "prompt": tokenizer.decode(prompt_ids),
            "response": tokenizer.decode(response_ids),
            "score": float(tensors[TOKEN_LEVEL_SCORES][row].sum()) if TOKEN_LEVEL_SCORES in tensors.keys() else None,
            "reward": float(tensors[TOKEN_LEVEL_REWARDS][row].sum()) if TOKEN_LEVEL_REWARDS in tensors.keys() else None,
            "truncated": bool(tensors[TRUNCATED][row]) if TRUNCATED in tensors.keys() else None,
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "response_mask": tensors[RESPONSE_MASK][row, :length].int().tolist(),
        }
        for key in columns:
            record[key] = tensors[key][row, :length].float().tolist()
        records.append(record)
    return records


def write_rollout_data(directory: str | Path, step: int, records: list[dict[str, Any]]) -> Path:
    """The step's file, written whole or not at all (a temporary file renamed into place)."""
    path = step_file(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".jsonl.tmp")
    with scratch.open("w") as file:
        for record in records:
            file.write(json.dumps(record) + "\n")
    os.replace(scratch, path)
    return path


def read_rollout_data(directory: str | Path, step: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in step_file(directory, step).read_text().splitlines()]
