"""The planner's predictions against measured GRPO steps on this machine (run by hand, not a test).

    .venv/bin/hybridflow plan --calibrate          # once: the cpu preset's coefficients
    .venv/bin/python bench/planner_check.py

Runs the job of bench/layouts.py (the arithmetic task, 6 prompts x 4 samples, 48 new tokens, one
thread per rank) as real ``hybridflow train`` runs: GRPO with SmolLM2-135M on 1 and 2 ranks and with the
8-head SmolLM2-sized model on 2 ranks in the three actor layouts (t=1; t=2, tg=1; t=2, tg=2); and PPO
with a critic (GAE) on 2 ranks in two placements: actor and critic colocated on both ranks, or a rank
each. For each it predicts the same step with the calibrated cost model (the measured mean prompt and
response lengths in place of the config's limits) and prints predicted against measured seconds per
stage of the colocated runs (medians over the steps after the first) and per step of every run (the
step's driver work, reward and advantages, is not in the model), their ratios, and the rank correlation
of the step times: over the actor layouts, over the placements, and over all runs.
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
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.planner import cluster_preset, workload_from_config
from hybridflow.planner.search import Plan, evaluate_set, step_plan
from hybridflow.trainer.setup.config import load_config

STAGES = ("gen", "old_log_prob", "values", "update_actor", "update_critic")
PPO = ("algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=6")
SPLIT = (
    "trainer.placement=custom",
    "trainer.resource_pool_spec.actor=[1]",
    "trainer.resource_pool_spec.critic=[1]",
    "trainer.role_pool.actor_rollout=actor",
    "trainer.role_pool.critic=critic",
)
# name: (model, ranks, t, tg, extra settings, the predicted plan's sets: (roles, devices) colocated)
ACTOR, CRITIC = Role.ActorRollout, Role.Critic
CASES = {
    "grpo smollm2 1 rank": ("smollm2-135m-instruct", 1, 1, 1, (), [((ACTOR,), 1)]),
    "grpo smollm2 2 ranks": ("smollm2-135m-instruct", 2, 1, 1, (), [((ACTOR,), 2)]),
    "grpo 8h t=1": ("smollm2-8h", 2, 1, 1, (), [((ACTOR,), 2)]),
    "grpo 8h t=2 tg=1": ("smollm2-8h", 2, 2, 1, (), [((ACTOR,), 2)]),
    "grpo 8h t=2 tg=2": ("smollm2-8h", 2, 2, 2, (), [((ACTOR,), 2)]),
    "ppo colocated": ("smollm2-135m-instruct", 2, 1, 1, PPO, [((ACTOR, CRITIC), 2)]),
    "ppo a rank each": ("smollm2-135m-instruct", 2, 1, 1, PPO + SPLIT, [((ACTOR,), 1), ((CRITIC,), 1)]),
}
LAYOUT_CASES = ("grpo 8h t=1", "grpo 8h t=2 tg=1", "grpo 8h t=2 tg=2")
PLACEMENT_CASES = ("ppo colocated", "ppo a rank each")


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected)."""

    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        return [order.index(i) for i in range(len(values))]

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def predict(args: argparse.Namespace, case: tuple, data: Path, measured: list[dict]) -> Plan:
    model, _, t, tg, extra, sets = case
    settings = [
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.model.path={model_path(model)}",
        "actor_rollout_ref.rollout.n=4",
        f"actor_rollout_ref.rollout.response_length={args.response_length}",
        *(e for e in extra if not e.startswith("trainer.")),
    ]
    workload = dataclasses.replace(
        workload_from_config(load_config(settings)),
        prompt_length=round(statistics.mean(r["prompt_length/mean"] for r in measured)),
        response_length=round(statistics.mean(r["response_length/mean"] for r in measured)),
    )
    cluster = cluster_preset("cpu")
    layouts = [
        {role: LayoutShape.over(devices, t, tg) if role is ACTOR else LayoutShape.over(devices) for role in roles}
        for roles, devices in sets
    ]
    return step_plan([evaluate_set(workload, cluster, chosen) for chosen in layouts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--response-length", type=int, default=48)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores); cpu preset: {cluster_preset('cpu')}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_task("arithmetic", data, train=256, test=8, seed=0)
        for name, case in CASES.items():
            model, ranks, t, tg, extra, _ = case
            run_args = argparse.Namespace(**vars(args), world=ranks)
            metrics = run(run_args, model_path(model), t, tg, data, Path(tmp) / name.replace(" ", "_"), extra)
            later = metrics[1:] or metrics  # the first step warms caches up
            measured = {
                key: statistics.median(r.get(f"timing_s/{key}", 0.0) for r in later) for key in (*STAGES, "step")
            }
            rows[name] = (measured, predict(args, case, data, later))
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"{'case':<22}" + "".join(f"{s:>22}" for s in (*STAGES, "step")) + "   (measured / predicted (ratio))")
    ratios = []
    for name, (measured, plan) in rows.items():
        predicted = {stage: sum(s.stage_seconds.get(stage, 0.0) for s in plan.sets) for stage in STAGES}
        predicted["step"] = plan.seconds
        colocated = len(plan.sets) == 1
        cells = ""
        for key in (*STAGES, "step"):
            if measured[key] == 0.0 or (key != "step" and not colocated):
                cells += f"{'-':>22}"
                continue
            ratios.append(predicted[key] / measured[key])
            cells += f"{measured[key]:>9.2f}/{predicted[key]:<6.2f}({ratios[-1]:.2f})"
        print(f"{name:<22}{cells}")
    spread = [max(r, 1 / r) for r in ratios]
    worst, mean = max(spread), statistics.geometric_mean(spread)
    print(f"predictions within {worst:.2f}x of measured at worst, {mean:.2f}x geometric mean")
    for label, names in (("actor layouts", LAYOUT_CASES), ("placements", PLACEMENT_CASES), ("all runs", tuple(rows))):
        steps = [(rows[n][0]["step"], rows[n][1].seconds) for n in names]
        print(f"rank correlation of step times, {label}: {spearman(*map(list, zip(*steps))):.2f}  ({steps})")


if __name__ == "__main__":
    main()
