"""The planner at the paper's scale, simulated: Llama 7B-70B actor/critic on 16-128 A100s (run by hand).

    .venv/bin/python bench/planner_scale.py --plot docs/images/planner_scale.png

PPO as in the HybridFlow paper's evaluation: actor and reference of one size, critic and reward model of
the same size, 1024 prompts of 1024 tokens, 1024-token responses, one sample each. For every model size
and cluster size it prints the planner's best plan and the predicted throughput (tokens per second) of
the best plan within each of the paper's placements: everything colocated, actor + reference apart
from critic + reward model, and each model on its own devices. Nothing here is measured: it is the cost
model (hybridflow/planner/cost.py) with the a100-80g preset's published figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.controller import Role
from hybridflow.planner import PAPER_MODELS, Plan, Workload, cluster_preset, plan_run

PLACEMENTS = {
    "colocate": lambda groups: len(groups) == 1,
    "split": lambda groups: (
        sorted(groups) == sorted([{Role.ActorRollout, Role.RefPolicy}, {Role.Critic, Role.RewardModel}], key=sorted)
    ),
    "standalone": lambda groups: len(groups) == 4,
}


def placement_of(plan: Plan) -> str | None:
    groups = [set(s.roles) for s in plan.sets]
    return next((name for name, matches in PLACEMENTS.items() if matches(groups)), None)


def describe(plan: Plan) -> str:
    parts = []
    for s in plan.sets:
        roles = ",".join(
            f"{r.value}(t{lay.t}" + (f",tg{lay.tg})" if r is Role.ActorRollout else ")") for r, lay in s.layouts.items()
        )
        parts.append(f"{s.devices}:{roles}")
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name, shape in PAPER_MODELS.items():
        models = {role: shape for role in (Role.ActorRollout, Role.RefPolicy, Role.Critic, Role.RewardModel)}
        work = Workload(
            models=models, prompts=1024, n=1, prompt_length=1024, response_length=1024, micro_batch=2,
            gradient_checkpointing=True,
        )  # fmt: skip
        results[name] = {}
        for gpus in (16, 32, 64, 128):
            try:
                plans = plan_run(work, cluster_preset("a100-80g", nodes=gpus // 8))
            except ValueError:
                print(f"{name:<10} {gpus:>4} GPUs: nothing fits")
                continue
            throughput = {"planner": work.tokens / plans[0].seconds}
            for plan in plans:
                placement = placement_of(plan)
                if placement is not None and placement not in throughput:
                    throughput[placement] = work.tokens / plan.seconds
            results[name][gpus] = throughput
            cells = "  ".join(f"{k} {v:>8.0f}" for k, v in throughput.items())
            print(f"{name:<10} {gpus:>4} GPUs: {cells} tokens/s; best: {describe(plans[0])}")
    if args.plot is not None:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


def plot(results: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 3.4))
    FigureCanvasAgg(figure)
    for index, (name, by_gpus) in enumerate(results.items()):
        axes = figure.add_subplot(1, len(results), index + 1)
        for placement in (*PLACEMENTS, "planner"):
            points = [(g, t[placement]) for g, t in by_gpus.items() if placement in t]
            if points:
                style = (
                    {"linestyle": "--", "color": "black", "zorder": 3} if placement == "planner" else {"marker": "o"}
                )
                axes.plot(*zip(*points), label=placement, **style)
        axes.set_title(name)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("A100 GPUs")
        axes.grid(alpha=0.3)
        if index == 0:
            axes.set_ylabel("predicted tokens / s")
            axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
