"""Metrics of one training step, computed on the driver from the step's batch."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import torch

from hybridflow.algorithms import masked_mean, masked_var
from hybridflow.protocol import DataProto


@contextlib.contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def reduce_worker_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Mean over ranks of each metric a worker group returned."""
    collected: dict[str, list[float]] = defaultdict(list)
    for metrics in per_rank:
        for key, value in metrics.items():
            collected[key].append(float(value))
    return {key: float(np.mean(values)) for key, values in collected.items()}


def data_metrics(batch: DataProto, response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, lengths, entropy and (with a critic) values of a step's batch."""
    tensors = batch.batch
    mask = tensors["response_mask"].bool()
    sequence_mask = mask.any(dim=1)
    response_lengths = tensors["response_mask"].sum(dim=1).float()
    prompt_lengths = tensors["attention_mask"][:, :-response_length].sum(dim=1).float()
    metrics = {
        **_stats("critic/score", tensors["token_level_scores"].sum(dim=1)),
        **_stats("critic/rewards", tensors["token_level_rewards"].sum(dim=1)),
        **_stats("critic/advantages", tensors["advantages"][mask]),
        **_stats("critic/returns", tensors["returns"][mask]),
        **_stats("response_length", response_lengths),
        **_stats("prompt_length", prompt_lengths),
        "response_length/clip_ratio": (response_lengths >= response_length).float().mean().item(),
        "response/aborted_ratio": 1.0 - sequence_mask.float().mean().item(),
    }
    if "entropys" in tensors.keys():
        metrics["actor/entropy"] = masked_mean(tensors["entropys"], tensors["response_mask"]).item()
    if "values" in tensors.keys():
        returns, values = tensors["returns"], tensors["values"]
        metrics.update(_stats("critic/values", values[mask]))
        variance = masked_var(returns, tensors["response_mask"])
        metrics["critic/vf_explained_var"] = (
            1.0 - masked_var(returns - values, tensors["response_mask"]) / (variance + 1e-8)
        ).item()
    return metrics


def throughput_metrics(batch: DataProto, timings: dict[str, float], world_size: int) -> dict[str, float]:
    step_time = timings.get("step", 0.0)
    total_tokens = float(batch.batch["attention_mask"].sum())
    response_tokens = float(batch.batch["response_mask"].sum())
    metrics = {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    if step_time > 0:
        metrics["perf/tokens_per_second"] = total_tokens / step_time
        metrics["perf/tokens_per_second_per_worker"] = total_tokens / step_time / world_size
    if timings.get("gen", 0.0) > 0:
        metrics["perf/generated_tokens_per_second"] = response_tokens / timings["gen"]
    metrics["perf/total_tokens"] = total_tokens
    return metrics


def log_prob_mismatch(batch: DataProto) -> dict[str, float]:
    """How far the generator's log-probs are from the trainer's for the same tokens (masked)."""
    mask = batch.batch["response_mask"].bool()
    diff = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {"rollout/log_prob_diff_mean": diff.mean().item(), "rollout/log_prob_diff_max": diff.max().item()}
