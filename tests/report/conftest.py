import json
import math
import random

import pytest

STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor")


def training_metrics(step: int, rng: random.Random) -> dict[str, float]:
    """What one GRPO step logs (names as in hybridflow/trainer/services/metrics.py and the workers' updates)."""
    progress = 1 - math.exp(-step / 8)
    score = 0.2 + 0.6 * progress + rng.uniform(-0.05, 0.05)
    length = 40 + 30 * progress + rng.uniform(-3, 3)
    timings = {name: rng.uniform(0.5, 1.5) * weight for name, weight in zip(STAGES, (6.0, 0.3, 1.2, 1.0, 0.05, 3.0))}
    metrics = {
        "critic/score/mean": score,
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        "critic/rewards/mean": score,
        "critic/advantages/mean": 0.0,
        "response_length/mean": length,
        "response_length/max": length + 20,
        "response_length/min": length - 25,
        "response_length/clip_ratio": 0.02 * rng.random(),
        "actor/entropy": 1.2 - 0.5 * progress,
        "actor/pg_loss": rng.uniform(-0.05, 0.05),
        "actor/ppo_kl": 1e-3 * rng.random(),
        "actor/pg_clipfrac": 0.01 + 0.01 * rng.random(),
        "actor/grad_norm": 0.8 + 0.4 * rng.random(),
        "actor/kl_loss": 0.002 * step,
        "actor/lr": 1e-6,
        "agent/tool_call_rate": 0.3 + 0.6 * progress,
        "agent/tool_calls_per_sample": 0.4 + 0.7 * progress,
        "agent/num_turns/mean": 1.3 + 0.6 * progress,
        "agent/num_turns/min": 1.0,
        "agent/num_turns/max": 3.0,
        "agent/tool_error_rate": 0.8 * (1 - progress),
        "agent/tool_errors_per_sample": 0.5 * (1 - progress),
        "agent/stop/no_tool_call": 0.8 + 0.15 * progress,
        "agent/stop/length": 0.2 - 0.15 * progress,
        "agent/stop/failed": 0.0,
        # a fully asynchronous run with partial rollout (trainer/loop/async_queue.py), max_staleness 2
        "async/staleness/mean": min(step - 1, 2) * 0.6,
        "async/staleness/min": 0.0,
        "async/staleness/max": float(min(step - 1, 2)),
        "async/staleness/frac_0": 0.4,
        "async/staleness/frac_1": 0.6 if step > 1 else 0.0,
        "async/staleness/frac_2": 0.0,
        "async/token_staleness/mean": min(step - 1, 2) * 0.4,
        "async/queue_groups": float(rng.randint(0, 8)),
        "async/dropped_groups": 0.0,
        "async/requeued_groups": 0.0,
        "async/continued_samples": float(rng.randint(0, 4)),
        "async/trainer_wait_s": rng.uniform(0.0, 2.0),
        "async/rollouter_idle_s": rng.uniform(0.0, 1.0),
        "async/push_wait_s": rng.uniform(0.0, 0.2),
        # what a DPO and a reward-model run log (their own trainers; one run here draws every figure)
        "dpo/loss": 0.69 - 0.3 * progress,
        "dpo/reward_accuracy": 0.5 + 0.4 * progress,
        "dpo/chosen_reward": 0.5 * progress,
        "dpo/rejected_reward": -0.5 * progress,
        "dpo/grad_norm": 2.0 + rng.random(),
        "rm/loss": 0.69 - 0.4 * progress,
        "rm/accuracy": 0.5 + 0.45 * progress,
        "rm/chosen_score": 2.0 * progress,
        "rm/rejected_score": -2.0 * progress,
        "rm/grad_norm": 5.0 + rng.random(),
        # a mixture of experts' routers (engine/moe.py)
        "actor/router_aux_loss": 2.0 + 0.1 * rng.random(),
        **{f"actor/expert_load_max/layer_{layer}": 1.0 + 0.5 * progress + 0.1 * layer for layer in range(3)},
        **{f"timing_s/{name}": seconds for name, seconds in timings.items()},
        "timing_s/step": sum(timings.values()) + 0.1,
    }
    metrics["perf/tokens_per_second"] = 64 * (length + 30) / metrics["timing_s/step"]
    return metrics


def validation(step: int) -> dict[str, float]:
    progress = 1 - math.exp(-step / 8)
    out = {}
    for source, base in (("arithmetic", 0.3), ("countdown", 0.1)):
        out[f"val/{source}/score_mean"] = base + 0.5 * progress
        out[f"val/{source}/mean@4"] = base + 0.5 * progress
        for k in (1, 2, 4):
            out[f"val/{source}/pass@{k}"] = min(1.0, (base + 0.5 * progress) * (1 + 0.4 * math.log2(k)))
    out["val/score/mean"] = (out["val/arithmetic/score_mean"] + out["val/countdown/score_mean"]) / 2
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run dir with config.yaml and 24 steps of metrics.jsonl: validation at 0 and every 8 steps."""
    rng = random.Random(0)
    run = tmp_path_factory.mktemp("runs") / "hybridflow" / "grpo-arith"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("algorithm:\n  adv_estimator: grpo\ntrainer:\n  total_training_steps: 24\n")
    lines = [json.dumps({"step": 0, **validation(0)})]
    for step in range(1, 25):
        row = training_metrics(step, rng)
        if step % 8 == 0:
            row.update(validation(step))
        lines.append(json.dumps({"step": step, **row}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.fixture(scope="module")
def report_page(run_dir):
    """The report of ``run_dir``, rendered once per module."""
    from hybridflow.report import write_report

    return write_report(run_dir)
