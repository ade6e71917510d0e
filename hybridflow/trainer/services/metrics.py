"""Metrics of one training step, computed on the driver from the step's batch."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms import masked_mean, masked_var
from hybridflow.batch_keys import (
    ADVANTAGES,
    AGENT_BRANCHES,
    AGENT_GENERATED_TOKENS,
    AGENT_METRICS,
    AGENT_PARSE_FAILURES,
    AGENT_REQUESTS,
    AGENT_SERVER_SECONDS,
    ATTENTION_MASK,
    ENTROPYS,
    GENERATED_MASK,
    LAST_BRANCH,
    NUM_TURNS,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    RESPONSES,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    STOP_REASON,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    TOOL_CALLS,
    TOOL_ERRORS,
    VALUES,
)
from hybridflow.protocol import DataProto


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def data_metrics(batch: DataProto, response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, lengths, entropy and (with a critic) values of a step's batch.

    Lengths describe the responses as generated; advantages, returns, entropy and values the tokens
    the updates trained on (``response_mask``, after any loss mask). Scores and rewards count samples: with agent
    sessions trained on several branches, each session once (its last branch, which its reward was given for)."""
    tensors = batch.batch
    mask = tensors[RESPONSE_MASK].bool()
    samples = tensors[LAST_BRANCH] if LAST_BRANCH in tensors.keys() else slice(None)
    sequence_mask = generated_mask(batch).bool().any(dim=1)
    response_lengths = response_tokens(batch).sum(dim=1).float()  # multi-turn: tool output included
    prompt_lengths = tensors[ATTENTION_MASK][:, :-response_length].sum(dim=1).float()
    metrics = {
        **_stats("critic/score", tensors[TOKEN_LEVEL_SCORES][samples].sum(dim=1)),
        **_stats("critic/rewards", tensors[TOKEN_LEVEL_REWARDS][samples].sum(dim=1)),
        **_stats("critic/advantages", tensors[ADVANTAGES][mask]),
        **_stats("critic/returns", tensors[RETURNS][mask]),
        **_stats("response_length", response_lengths),
        **_stats("prompt_length", prompt_lengths),
        "response_length/clip_ratio": (response_lengths >= response_length).float().mean().item(),
        "response/aborted_ratio": 1.0 - sequence_mask.float().mean().item(),
    }
    if ENTROPYS in tensors.keys():
        metrics["actor/entropy"] = masked_mean(tensors[ENTROPYS], tensors[RESPONSE_MASK]).item()
    if VALUES in tensors.keys():
        returns, values = tensors[RETURNS], tensors[VALUES]
        metrics.update(_stats("critic/values", values[mask]))
        variance = masked_var(returns, tensors[RESPONSE_MASK])
        metrics["critic/vf_explained_var"] = (
            1.0 - masked_var(returns - values, tensors[RESPONSE_MASK]) / (variance + 1e-8)
        ).item()
    return metrics


def throughput_metrics(batch: DataProto, timings: dict[str, float], world_size: int) -> dict[str, float]:
    step_time = timings.get("step", 0.0)
    total_tokens = float(batch.batch[ATTENTION_MASK].sum())
    generated_tokens = float(generated_mask(batch).sum())
    metrics = {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    if step_time > 0:
        metrics["perf/tokens_per_second"] = total_tokens / step_time
        metrics["perf/tokens_per_second_per_worker"] = total_tokens / step_time / world_size
    if timings.get("gen", 0.0) > 0:
        metrics["perf/generated_tokens_per_second"] = generated_tokens / timings["gen"]
    metrics["perf/total_tokens"] = total_tokens
    return metrics


def response_tokens(batch: DataProto) -> torch.Tensor:
    """(B, R) 1 on every real response token: generated ones and, in multi-turn rollout, inserted ones."""
    return batch.batch[ATTENTION_MASK][:, -batch.batch[RESPONSES].shape[1] :]


def generated_mask(batch: DataProto) -> torch.Tensor:
    """(B, R) 1 on every generated response token: the response mask as generation made it, before
    any loss mask (rejection, truncated responses) changed ``response_mask``."""
    return batch.batch[GENERATED_MASK]


def agent_metrics(batch: DataProto) -> dict[str, float]:
    """What the multi-turn rollout's conversations did (none for one-shot generation): turns per sample,
    tool calls per sample and the fraction of samples making any, tool errors per call, why they ended."""
    tensors = batch.batch
    if NUM_TURNS not in tensors.keys():
        return {}
    branch_metrics = {}
    if LAST_BRANCH in tensors.keys():  # sessions trained on several branches: the session metrics count sessions
        branch_metrics = trained_branch_metrics(batch)
        batch = batch[np.flatnonzero(tensors[LAST_BRANCH].cpu().numpy())]
        tensors = batch.batch
    calls, errors = tensors[TOOL_CALLS].float(), tensors[TOOL_ERRORS].float()
    metrics = {
        **_stats("agent/num_turns", tensors[NUM_TURNS]),
        "agent/tool_calls_per_sample": calls.mean().item(),
        "agent/tool_call_rate": (calls > 0).float().mean().item(),
        "agent/tool_errors_per_sample": errors.mean().item(),
        "agent/tool_error_rate": (errors.sum() / calls.sum()).item() if calls.sum() > 0 else 0.0,
    }
    reasons = list(batch.non_tensor_batch[STOP_REASON])
    for reason in sorted(set(reasons) | {"failed"}):
        metrics[f"agent/stop/{reason}"] = reasons.count(reason) / len(reasons)
    return metrics | endpoint_metrics(batch) | branch_metrics


def trained_branch_metrics(batch: DataProto) -> dict[str, float]:
    """How much of what the sessions generated is trained: rows (branches) per session, and the share of every token
    the model generated in the sessions, on all their branches, that is in the update (1.0 unless sessions failed or
    ran past the response length)."""
    tensors = batch.batch
    last = tensors[LAST_BRANCH]
    sessions = max(int(last.sum()), 1)
    generated = float(tensors[AGENT_GENERATED_TOKENS][last].sum())
    trained = float(generated_mask(batch).sum())
    return {
        "agent/trained_branches_per_session": len(batch) / sessions,
        "agent/trained_token_share": trained / generated if generated else 1.0,
    }


def endpoint_metrics(batch: DataProto) -> dict[str, float]:
    """What the agent endpoint's sessions did (rollout.agent): requests and branches per session, tool-call markup
    that did not parse per request, the endpoint's own time per request, and the numbers the agents returned."""
    tensors = batch.batch
    if AGENT_REQUESTS not in tensors.keys():
        return {}
    requests = tensors[AGENT_REQUESTS].float()
    total = max(requests.sum().item(), 1.0)
    metrics = {
        "agent/requests_per_session": requests.mean().item(),
        "agent/branches_per_session": tensors[AGENT_BRANCHES].float().mean().item(),
        "agent/parse_failures_per_request": tensors[AGENT_PARSE_FAILURES].float().sum().item() / total,
        "agent/server_ms_per_request": 1000 * tensors[AGENT_SERVER_SECONDS].float().sum().item() / total,
    }
    returned: dict[str, list[float]] = {}
    for values in batch.non_tensor_batch[AGENT_METRICS]:
        for name, value in (values or {}).items():
            returned.setdefault(name, []).append(value)
    metrics |= {f"agent/returned/{name}": sum(v) / len(v) for name, v in returned.items()}
    return metrics


def log_prob_mismatch(batch: DataProto) -> dict[str, float]:
    """How far the generator's log-probs are from the trainer's for the same tokens (every generated one)."""
    mask = generated_mask(batch).bool()
    diff = (batch.batch[ROLLOUT_LOG_PROBS] - batch.batch[OLD_LOG_PROBS]).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {"rollout/log_prob_diff_mean": diff.mean().item(), "rollout/log_prob_diff_max": diff.max().item()}
