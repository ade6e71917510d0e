"""A model's answers to task rows, generated and scored by the trainer's own parts, before any training.

The commands that look at what a model answers (``hybridflow measure``: its accuracy; ``hybridflow distill-data``:
a teacher's answers as SFT rows) share the three steps here, in this order, so that every mistake in the input is
reported before a model loads:

    rows = scorable_rows(parser, task=..., data=..., n=..., split=..., seed=...)  # no model yet
    generator = load_generator(model, dtype, rows, multi_turn=is_multi_turn(rows), tools=...)
    batch, result = generator.generate(params, samples=1)  # rollout columns + the reward manager's scores

Generation is the native engine's (the default rollout settings; for rows that name an agent loop, the agent
rollout with the given tools); scoring is the trainer's reward manager.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.validation import ArgumentParser, reading_file

if TYPE_CHECKING:
    from hybridflow.data import RLHFDataset
    from hybridflow.protocol import DataProto
    from hybridflow.reward.manager import RewardManager, RewardResult
    from hybridflow.rollout.base import Rollout, SamplingParams

MODEL_FIX = "a built-in name (smollm2-135m-instruct, tiny-llama) or a model folder"


def scorable_rows(
    parser: ArgumentParser, *, task: str | None, data: str, n: int, split: str, seed: int
) -> list[dict[str, Any]]:
    """The first ``n`` rows of a built-in ``task``'s ``split`` (drawn with ``seed``), or of the file ``data``; each
    one's data source has a scorer. A problem is the parser's error (the command's name, exit 2), before any model
    loads."""
    from hybridflow.batch_keys import DATA_SOURCE
    from hybridflow.data.io import read_rows
    from hybridflow.data.tasks import make_task_rows
    from hybridflow.reward import RewardFailure, check_scorable

    if data:
        with reading_file(data, key="--data", fix="a parquet or jsonl file of task rows"):
            rows = read_rows(data)[:n]
    else:
        rows = make_task_rows(task, n, split, seed)
    if any(str(row.get(DATA_SOURCE, "")).startswith("verifiers:") for row in rows):
        parser.error(
            "--data: these rows name a verifiers environment's tasks, which its episodes score; evaluate them with "
            "a run's validation (rollout.agent.verifiers, docs/environments.md)"
        )
    try:  # every row scorable, before a model is loaded
        check_scorable(rows, multi_turn=is_multi_turn(rows))
    except RewardFailure as error:
        parser.error(f"--data: {error}")
    return rows


def is_multi_turn(rows: list[dict[str, Any]]) -> bool:
    """Whether any row names an agent loop (a multi-turn task: the model calls tools between turns)."""
    from hybridflow.batch_keys import AGENT_NAME

    return any(row.get(AGENT_NAME) for row in rows)


@dataclasses.dataclass(frozen=True)
class Generator:
    """A loaded model with the rows it answers: the rows as the trainer's dataset, its rollout and reward manager."""

    tokenizer: Any
    dataset: RLHFDataset  # the rows, their prompts templated and tokenised
    rollout: Rollout  # the native engine (an agent rollout for multi-turn rows)
    reward: RewardManager

    def generate(self, params: SamplingParams, samples: int = 1) -> tuple[DataProto, RewardResult]:
        """Every row's prompt answered ``samples`` times (a row's samples next to each other) with ``params``
        (each sample its own random stream) and scored. Returns the batch (the dataset's
        columns, the rollout's columns: responses, response_mask, truncated, ...) and the RewardResult
        (``extra["score"]``, ``extra["acc"]`` per sample)."""
        from hybridflow.batch_keys import AGENT_NAME, EXTRA_INFO, PROMPT_TENSORS

        dataset = self.dataset
        batch = dataset.collate([dataset[i] for i in range(len(dataset))])
        if samples > 1:
            batch = batch.repeat(samples, interleave=True)
        prompts = batch.select(batch_keys=list(PROMPT_TENSORS), non_tensor_batch_keys=[AGENT_NAME, EXTRA_INFO])
        generated = self.rollout.generate_sequences(prompts.select(deepcopy=True), params)
        batch.pop(batch_keys=list(PROMPT_TENSORS))
        batch.union(generated)
        return batch, self.reward(batch)


def load_generator(
    model_path: str, dtype: str, rows: list[dict[str, Any]], *, multi_turn: bool = False, tools: Any = None
) -> Generator:
    """Load the model and tokenizer at ``model_path`` (a built-in name or a model folder; a problem names --model)
    in ``dtype`` ("bfloat16" or "float32") and make its rollout and the dataset of ``rows``. ``multi_turn``: run
    the rows' agent loops with ``tools`` (the loaded tools)."""
    import torch

    from hybridflow.data import RLHFDataset
    from hybridflow.data.io import write_rows
    from hybridflow.models import load_causal_lm, load_tokenizer, model_config
    from hybridflow.reward import RewardManager
    from hybridflow.rollout.build import build_rollout
    from hybridflow.trainer.setup.config import default_config

    config = default_config()
    with reading_file(model_path, key="--model", fix=MODEL_FIX):
        model_config(model_path)  # there, before a built-in is built or anything loads
    with reading_file(model_path, key="--model", fix=MODEL_FIX):
        tokenizer = load_tokenizer(model_path)
        model = load_causal_lm(model_path, dtype=getattr(torch, dtype)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_rows(rows, Path(tmp) / "rows.parquet")
        dataset = RLHFDataset(path, tokenizer, dataclasses.replace(config.data, max_prompt_length=2048))
    # the default rollout settings (the native engine), with agent loops for multi-turn tasks
    rollout_config = config.actor_rollout_ref.rollout
    rollout_config = dataclasses.replace(
        rollout_config, multi_turn=dataclasses.replace(rollout_config.multi_turn, enable=multi_turn)
    )
    rollout = build_rollout(model, tokenizer, rollout_config, tools=tools)
    return Generator(tokenizer, dataset, rollout, RewardManager(tokenizer, config.reward))
