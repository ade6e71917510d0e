"""The planner's predictions against measured GRPO steps on this machine (run by hand, not a test).

    .venv/bin/hybridflow plan --calibrate          # once: the cpu preset's coefficients
    .venv/bin/python bench/planner_check.py

Runs the GRPO job of bench/layouts.py (the arithmetic task, 6 prompts x 4 samples, 48 new tokens, one
thread per rank) as real ``hybridflow train`` runs: SmolLM2-135M on 1 and 2 ranks, and the 8-head
SmolLM2-sized model on 2 ranks in the three actor layouts (t=1; t=2, tg=1; t=2, tg=2). For each it
predicts the same step with the calibrated cost model (the measured mean prompt and response lengths in
place of the config's limits) and prints predicted against measured seconds per stage (medians over the
steps after the first), the error of each, and the rank correlation of the step times.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path

from layouts import run
from reshard import model_path

from hybridflow.controller import Role
from hybridflow.data.tasks import write_task
from hybridflow.planner import cluster_preset, workload_from_config
from hybridflow.planner.cost import Layout
from hybridflow.planner.search import evaluate_set
from hybridflow.trainer.config import load_config

STAGES = {"gen": "timing_s/gen", "old_log_prob": "timing_s/old_log_prob", "update_actor": "timing_s/update_actor"}
CASES = [  # (model, ranks, t, tg)
    ("smollm2-135m-instruct", 1, 1, 1),
    ("smollm2-135m-instruct", 2, 1, 1),
    ("smollm2-8h", 2, 1, 1),
    ("smollm2-8h", 2, 2, 1),
    ("smollm2-8h", 2, 2, 2),
]


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected)."""

    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        return [order.index(i) for i in range(len(values))]

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def predict(args: argparse.Namespace, path: str, ranks: int, t: int, tg: int, data: Path, measured: list[dict]) -> dict:
    config = load_config(
        [
            f"data.train_files=[{data / 'train.parquet'}]",
            f"data.train_batch_size={args.prompts}",
            f"actor_rollout_ref.model.path={path}",
            "actor_rollout_ref.rollout.n=4",
            f"actor_rollout_ref.rollout.response_length={args.response_length}",
        ]
    )
    workload = dataclasses.replace(
        workload_from_config(config),
        prompt_length=round(statistics.mean(r["prompt_length/mean"] for r in measured)),
        response_length=round(statistics.mean(r["response_length/mean"] for r in measured)),
    )
    cluster = cluster_preset("cpu")
    device_set = evaluate_set(workload, cluster, {Role.ActorRollout: Layout(ranks, t, tg)})
    return device_set.stage_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--response-length", type=int, default=48)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores); cpu preset: {cluster_preset('cpu')}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_task("arithmetic", data, train=256, test=8, seed=0)
        for model, ranks, t, tg in CASES:
            path = model_path(model)
            run_args = argparse.Namespace(**vars(args), world=ranks)
            metrics = run(run_args, path, t, tg, data, Path(tmp) / f"{model}_{ranks}_{t}_{tg}")
            later = metrics[1:] or metrics
            measured = {stage: statistics.median(r[key] for r in later) for stage, key in STAGES.items()}
            predicted = predict(args, path, ranks, t, tg, data, later)
            rows.append((f"{model} ranks={ranks} t={t} tg={tg}", measured, predicted))
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"{'case':<40}" + "".join(f"{s + ' meas/pred':>24}" for s in STAGES) + f"{'sum meas/pred':>20}")
    errors = []
    for name, measured, predicted in rows:
        cells = ""
        for stage in STAGES:
            errors.append(predicted[stage] / measured[stage])
            cells += f"{measured[stage]:>12.2f}/{predicted[stage]:<7.2f}({predicted[stage] / measured[stage]:.2f})"
        total_m, total_p = sum(measured.values()), sum(predicted[s] for s in STAGES)
        print(f"{name:<40}{cells}{total_m:>10.2f}/{total_p:<7.2f}({total_p / total_m:.2f})")
    worst = max(max(e, 1 / e) for e in errors)
    geo = statistics.geometric_mean([max(e, 1 / e) for e in errors])
    print(f"stage predictions: within {worst:.2f}x of measured at worst, {geo:.2f}x geometric mean")
    sums = [(sum(m.values()), sum(p[s] for s in STAGES)) for _, m, p in rows]
    layouts = sums[2:]
    print(f"rank correlation of the 3 actor layouts' step times: {spearman(*map(list, zip(*layouts))):.2f}")
    print(f"rank correlation over all {len(sums)} cases: {spearman(*map(list, zip(*sums))):.2f}")


if __name__ == "__main__":
    main()
