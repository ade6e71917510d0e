"""The reward manager: decode each response, score it, put the score on its last token.

    manager = RewardManager(tokenizer, config)                # scorers chosen by data_source
    manager = RewardManager(tokenizer, config, custom_fn=fn)  # fn(data_source, solution_str, ground_truth, extra_info)
    check_scorable(rows, custom_fn)                   # before training: every row can be scored
    result = manager(batch)                           # batch: a rollout DataProto
    result.token_level_scores                         # (B, R) float32, one nonzero column per row at most

Before training (before a model is built), ``check_scorable`` makes sure that every data source has a scorer and that a
custom function returns a score for a real row, so a run cannot "succeed" on zero rewards.
During training a rare failure (a scorer that raises, or returns something that is not a
finite number or a dict with one under "score") must not end a run of many hours: that sample
scores 0, the failure is counted in `reward/scorer_failures`, and each kind of failure (data
source and exception type) is logged once with its traceback. When more than
``reward.max_failure_rate`` of a call's samples fail, the run stops with ``RewardFailure``,
which shows the first failure's traceback.
"""

from __future__ import annotations

import logging
import math
import numbers
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hybridflow.reward.scorers  # noqa: F401  (registers the built-in scorers)
from hybridflow.batch_keys import (
    AGENT_REWARD,
    ATTENTION_MASK,
    DATA_SOURCE,
    EXTRA_INFO,
    FINAL_RESPONSE,
    LAST_BRANCH,
    NUM_TURNS,
    RESPONSE_MASK,
    RESPONSES,
    REWARD_MODEL,
    STOP_REASON,
    TOOL_CALLS,
    TOOL_ERRORS,
    TOOL_REWARDS,
    TURN_ENDS,
    TURN_SCORES,
)
from hybridflow.protocol import DataProto
from hybridflow.reward.config import RewardConfig
from hybridflow.reward.registry import UnknownDataSourceError, get_scorer, list_scorers
from hybridflow.reward.turns import place_rewards
from hybridflow.validation import UserError

logger = logging.getLogger(__name__)

CustomRewardFn = Callable[[str, str, Any, dict | None], float | dict]


@dataclass
class RewardResult:
    """What the manager returns for one batch."""

    token_level_scores: torch.Tensor  # (B, R) float32: each sample's score at its last response token
    extra: dict[str, list[Any]] = field(default_factory=dict)  # per-sample values: score, acc, failed, scorer extras
    metrics: dict[str, float] = field(default_factory=dict)  # reward/scorer_failures, reward/<data_source>/mean, ...


class ScorerFailure(Exception):
    """A scorer returned something that is not a usable score."""


def describe_failure(error: BaseException) -> str:
    """The exception with the frames of the scoring code that raised it (hybridflow's own frames left out)."""
    package = str(Path(__file__).resolve().parents[1])
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if not str(Path(f.filename).resolve()).startswith(package)
    ]
    where = "".join(traceback.format_list(frames))
    return where + "".join(traceback.format_exception_only(error)).rstrip()


class RewardFailure(UserError):
    """The data cannot be scored (found before training), or too many samples of a call failed to score."""


def _as_score(result: Any) -> tuple[float, dict[str, Any]]:
    """(score, extras) from a scorer's return value; ScorerFailure if there is no finite number."""
    extras: dict[str, Any] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ScorerFailure(f"the scorer returned a dict without a 'score' key: keys {sorted(result)}")
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if isinstance(result, np.generic) or (isinstance(result, torch.Tensor) and result.numel() == 1):
        result = result.item()  # numpy and torch scalars (np.bool_ is not a numbers.Real)
    if not isinstance(result, numbers.Real) or not math.isfinite(float(result)):
        raise ScorerFailure(f"the scorer returned {result!r} ({type(result).__name__}), not a finite number")
    return float(result), extras


def check_scorable(
    rows: Iterable[dict[str, Any]], custom_fn: CustomRewardFn | None = None, multi_turn: bool = False
) -> None:
    """RewardFailure unless every row's data source has a scorer (without a custom function) and,
    with one, it returns a score for the first row given that row's ground truth as the answer (in a
    multi-turn run: as a one-turn conversation's answer, with the conversation facts it will get).
    Needs no tokenizer: a run calls it before it builds a model."""
    rows = list(rows)
    if custom_fn is not None:
        if rows:
            _check_custom_fn(custom_fn, rows[0], multi_turn)
        return
    counts: dict[str, int] = defaultdict(int)
    for row in rows:
        counts[str(row[DATA_SOURCE])] += 1
    unknown = {}
    for source, count in counts.items():
        try:
            get_scorer(source)
        except UnknownDataSourceError:
            unknown[source] = count
    if unknown:
        listed = ", ".join(f"{source!r} ({count} rows)" for source, count in sorted(unknown.items()))
        raise RewardFailure(
            f"no reward scorer for data_source {listed}; scorers exist for {', '.join(list_scorers())}. "
            "Register one with hybridflow.reward.register_scorer, or give custom_reward_function.path"
        )


def _check_custom_fn(custom_fn: CustomRewardFn, row: dict[str, Any], multi_turn: bool) -> None:
    ground_truth = row[REWARD_MODEL]["ground_truth"]
    extra_info = row.get(EXTRA_INFO)
    if multi_turn:
        extra_info = {**(extra_info or {}), **one_turn_facts(str(ground_truth))}
    try:
        _as_score(custom_fn(str(row[DATA_SOURCE]), str(ground_truth), ground_truth, extra_info))
    except Exception as error:  # noqa: BLE001  (whatever it raises, the run must not start)
        raise RewardFailure(
            "the custom reward function (custom_reward_function.path / .name) failed on the first row, called as "
            "fn(data_source, solution_str, ground_truth, extra_info) with the row's ground truth as the answer:\n"
            + describe_failure(error)
        ) from error


class RewardManager:
    """Scores a rollout batch with rule-based scorers (or one custom function)."""

    def __init__(self, tokenizer: Any, config: RewardConfig, custom_fn: CustomRewardFn | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.custom_fn = custom_fn
        self._logged_failures: set[tuple[str, str]] = set()

    def check_scorable(self, rows: Iterable[dict[str, Any]], multi_turn: bool = False) -> None:
        """``check_scorable`` with this manager's custom function."""
        check_scorable(rows, self.custom_fn, multi_turn)

    def __call__(self, data: DataProto) -> RewardResult:
        responses = data.batch[RESPONSES]  # (B, R)
        batch_size, length = responses.shape
        positions = torch.arange(length).expand(batch_size, length)
        # the text is every response token (a multi-turn response holds the tool output the loop inserted);
        # the score goes on the last generated token; a row with none (an empty response) gets its score at
        # position 0, where the mask hides it from every loss
        present = data.batch[ATTENTION_MASK][:, -length:].bool().cpu()
        generated = data.batch[RESPONSE_MASK].bool().cpu()
        end = torch.where(present, positions, -1).max(dim=1).values  # (B,)
        last = torch.where(generated, positions, -1).max(dim=1).values  # (B,)
        response_ids = responses.cpu()
        texts = self.tokenizer.batch_decode(
            [response_ids[i, : int(end[i]) + 1].tolist() for i in range(batch_size)], skip_special_tokens=True
        )
        sources = data.non_tensor_batch[DATA_SOURCE]
        reward_models = data.non_tensor_batch[REWARD_MODEL]
        extra_infos = with_conversation_facts(data, self._final_turns(response_ids, present, generated, end))

        scores = torch.zeros(batch_size, dtype=torch.float32)
        per_sample: list[dict[str, Any]] = []
        failures: list[BaseException] = []
        agent_rewards = data.non_tensor_batch.get(AGENT_REWARD)  # the user's agents scored their own samples
        for i in range(batch_size):
            if agent_rewards is not None:
                score, extras, error = _agent_score(agent_rewards[i]), {}, None
            else:
                score, extras, error = self._score_one(str(sources[i]), texts[i], reward_models[i], extra_infos[i])
            scores[i] = score
            failures += [error] if error is not None else []
            per_sample.append({**extras, "score": score, "acc": extras.get("acc", score), "failed": error is not None})
        self._stop_if_failing(failures, batch_size)

        if TURN_ENDS in data.non_tensor_batch:
            token_level_scores = place_rewards(
                length,
                scores,
                last,
                data.non_tensor_batch[TURN_ENDS],
                data.non_tensor_batch[TURN_SCORES],
                data.non_tensor_batch[TOOL_REWARDS],
                coef=self.config.tool_reward_coef,
                turn_level=self.config.turn_level,
            )
        else:
            token_level_scores = torch.zeros(batch_size, length, dtype=torch.float32)
            token_level_scores[torch.arange(batch_size), last.clamp(min=0)] = scores
        self._examine(sources, texts, reward_models, per_sample)
        # the samples the metrics count: each agent session once, however many of its branches are rows
        last_branch = data.batch.get(LAST_BRANCH, None)
        counted = np.flatnonzero(last_branch.cpu().numpy()) if last_branch is not None else np.arange(batch_size)
        return RewardResult(
            token_level_scores=token_level_scores.to(responses.device),
            extra=_columns(per_sample),
            metrics=_metrics(sources[counted], [per_sample[i] for i in counted]),
        )

    def _final_turns(
        self, responses: torch.Tensor, present: torch.Tensor, generated: torch.Tensor, end: torch.Tensor
    ) -> list[str]:
        """Each row's last assistant turn as text: the tokens after the last one the agent loop inserted."""
        inserted = present & ~generated
        positions = torch.arange(responses.shape[1]).expand_as(responses)
        start = torch.where(inserted, positions, -1).max(dim=1).values + 1  # (B,)
        turns = [responses[i, int(start[i]) : int(end[i]) + 1].tolist() for i in range(responses.shape[0])]
        return self.tokenizer.batch_decode(turns, skip_special_tokens=True)

    def _stop_if_failing(self, failures: list[BaseException], batch_size: int) -> None:
        if len(failures) > self.config.max_failure_rate * batch_size:
            raise RewardFailure(
                f"{len(failures)} of {batch_size} samples failed to score, more than reward.max_failure_rate="
                f"{self.config.max_failure_rate}; the first failure:\n" + describe_failure(failures[0])
            )

    def _score_one(
        self, source: str, text: str, reward_model: Any, extra_info: Any
    ) -> tuple[float, dict, BaseException | None]:
        """(score, extras, the failure or None) for one sample; a failure scores 0 and is logged once per kind."""
        try:
            ground_truth = reward_model["ground_truth"]
            if self.custom_fn is not None:
                result = self.custom_fn(source, text, ground_truth, extra_info)
            else:
                result = get_scorer(source)(text, ground_truth, extra_info)
            score, extras = _as_score(result)
            return score, extras, None
        except Exception as error:  # noqa: BLE001  (any scorer bug must not end the run)
            kind = (source, type(error).__name__)
            if kind not in self._logged_failures:
                self._logged_failures.add(kind)
                logger.warning(
                    "reward scorer for data_source %r failed; the sample scores 0 and later failures of this "
                    "kind are only counted (reward/scorer_failures): %r",
                    source,
                    error,
                    exc_info=error,
                )
            return 0.0, {}, error

    def _examine(self, sources: np.ndarray, texts: list[str], reward_models: np.ndarray, rows: list[dict]) -> None:
        shown: dict[str, int] = defaultdict(int)
        for source, text, reward_model, row in zip(sources, texts, reward_models, rows, strict=True):
            if shown[source] < self.config.num_examine:
                shown[source] += 1
                truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else reward_model
                print(f"[{source}] score={row['score']:.3f} ground_truth={truth!r}\n{text}\n")


def _agent_score(reward: Any) -> float:
    """An agent's reward as a score: a failed agent's (NaN) is 0, and its sample has left the update."""
    reward = float(reward)
    return 0.0 if math.isnan(reward) else reward


def one_turn_facts(answer: str) -> dict[str, Any]:
    """The conversation facts of a one-turn answer without tool calls (what the pre-run check gives a reward
    function of a multi-turn run)."""
    return {
        FINAL_RESPONSE: answer,
        NUM_TURNS: 1,
        TOOL_CALLS: 0,
        TOOL_ERRORS: 0,
        TURN_SCORES: [0.0],
        TOOL_REWARDS: {},
        STOP_REASON: "no_tool_call",
    }


def with_conversation_facts(data: DataProto, final_turns: list[str]) -> np.ndarray:
    """Each row's extra_info, for the scorer; a multi-turn row's (rollout/agent) gets a copy with what happened in
    its conversation added: num_turns, tool_calls, tool_errors, turn_scores, tool_rewards, stop_reason, and
    final_response (the text of its last assistant turn: the answer, after the tools' output)."""
    batch_size = len(data)
    extra_infos = data.non_tensor_batch.get(EXTRA_INFO, np.full(batch_size, None, dtype=object))
    if TURN_ENDS not in data.non_tensor_batch:
        return extra_infos
    tensors, rows = data.batch, data.non_tensor_batch
    facts = {
        FINAL_RESPONSE: final_turns,
        NUM_TURNS: tensors[NUM_TURNS].tolist(),
        TOOL_CALLS: tensors[TOOL_CALLS].tolist(),
        TOOL_ERRORS: tensors[TOOL_ERRORS].tolist(),
        TURN_SCORES: rows[TURN_SCORES],
        TOOL_REWARDS: rows[TOOL_REWARDS],
        STOP_REASON: rows[STOP_REASON],
    }
    out = np.empty(batch_size, dtype=object)
    for i in range(batch_size):
        out[i] = {**(extra_infos[i] or {}), **{key: values[i] for key, values in facts.items()}}
    return out


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per-sample dicts to per-key lists of length B (None where a sample lacks a key)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return {key: [row.get(key) for row in rows] for key in keys}


def _metrics(sources: np.ndarray, rows: list[dict[str, Any]]) -> dict[str, float]:
    metrics: dict[str, float] = {"reward/scorer_failures": float(sum(row["failed"] for row in rows))}
    by_source: dict[str, list[dict]] = defaultdict(list)
    for source, row in zip(sources, rows, strict=True):
        by_source[str(source)].append(row)
    for source, group in sorted(by_source.items()):
        metrics[f"reward/{source}/mean"] = float(np.mean([row["score"] for row in group]))
        accs = [row["acc"] for row in group if isinstance(row["acc"], numbers.Real)]
        if accs:
            metrics[f"reward/{source}/acc"] = float(np.mean(accs))
    return metrics
