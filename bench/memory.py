"""Resident memory over a training run, per step: the workers' and the driver's (run by hand, not a test).

    .venv/bin/python bench/memory.py                         # 100 tiny-llama steps, then 30 smollm2 steps
    .venv/bin/python bench/memory.py --tiny-steps 100 --smollm2-steps 0 --out docs/images/memory.png
    .venv/bin/python bench/memory.py --baseline-capacity 1024   # also each model with torch's default caches

Each run is a real ``hybridflow train`` (2 workers on a local Ray cluster, the arithmetic task, GRPO,
no validation) whose metrics carry ``perf/worker_rss_gb`` (the workers' resident set after the update,
mean over ranks) and ``perf/driver_rss_gb``. The table gives the resident set at steps 1 and 5 and at
the end, and the growth per step after step 5 (least squares); the goal is under 1 MB per step. The
plot (one panel per run) goes to ``--out``. ``--baseline-capacity N`` adds, in the same invocation, a run
of each model with ``trainer.cpu_kernel_cache_capacity=N`` (1024: torch's default kernel caches).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridflow.data.tasks import write_task

GOAL_MB_PER_STEP = 1.0
WARM_UP_STEPS = 5


def run(model: str, steps: int, data: Path, run_dir: Path, extra: list[str]) -> list[dict]:
    args = [
        f"data.train_files=[{data / 'train.parquet'}]",
        "data.val_files=[]",
        f"actor_rollout_ref.model.path={model}",
        "trainer.val_before_train=false",
        "trainer.total_epochs=1000",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]
    print(f"{model}: {steps} steps ...", flush=True)
    subprocess.run(
        [sys.executable, "-m", "hybridflow.trainer.commands.train", *args], check=True, stdout=subprocess.DEVNULL
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def slope_mb_per_step(steps: list[int], values_gb: list[float]) -> float:
    """Least-squares growth per step, in MB."""
    n = len(steps)
    mean_x, mean_y = sum(steps) / n, sum(values_gb) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values_gb))
    variance = sum((x - mean_x) ** 2 for x in steps)
    return covariance / variance * 1024 if variance else 0.0


def summarize(name: str, records: list[dict]) -> dict:
    steps = [r["step"] for r in records]
    row = {"run": name}
    for key in ("perf/worker_rss_gb", "perf/driver_rss_gb"):
        values = [r[key] for r in records]
        late = [(s, v) for s, v in zip(steps, values) if s > WARM_UP_STEPS]
        row[key] = {
            "step 1": values[0],
            f"step {WARM_UP_STEPS}": values[min(WARM_UP_STEPS, len(values)) - 1],
            "last": values[-1],
            "MB/step after warm-up": slope_mb_per_step(*zip(*late)) if len(late) > 1 else float("nan"),
        }
    return row


def plot(results: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if len(results) > 2 else 1
    columns = -(-len(results) // rows)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for ax, (name, records) in zip(axes.T.flat, results.items()):
        steps = [r["step"] for r in records]
        for key, label in (("perf/worker_rss_gb", "worker (mean of 2)"), ("perf/driver_rss_gb", "driver")):
            ax.plot(steps, [r[key] for r in records], label=label)
        ax.set(title=name, xlabel="step", ylabel="resident memory (GiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny-steps", type=int, default=100)
    parser.add_argument("--smollm2-steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("docs/images/memory.png"))
    parser.add_argument("--baseline-capacity", type=int, default=0, help="also run with this kernel cache capacity")
    args = parser.parse_args()
    variants = [("", [])]
    if args.baseline_capacity:
        capacity = args.baseline_capacity
        variants.append((f", cache {capacity}", [f"trainer.cpu_kernel_cache_capacity={capacity}"]))
    demo = [  # the demo's batch shape (examples/grpo_arithmetic_smollm2.yaml)
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.rollout.response_length=32",
    ]
    models = [
        ("tiny-llama", "tiny-llama", args.tiny_steps, ["actor_rollout_ref.rollout.response_length=32"]),
        ("smollm2-135m", "smollm2-135m-instruct", args.smollm2_steps, demo),
    ]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        write_task("arithmetic", data, train=2000, test=10, seed=0)
        for label, model, steps, settings in models:
            for suffix, variant in variants if steps else []:
                name = f"{label}, {steps} steps{suffix}"
                results[name] = run(model, steps, data, Path(scratch) / name.replace(" ", "_"), [*settings, *variant])
    print(f"\n| run | process | step 1 (GiB) | step {WARM_UP_STEPS} | last | MB/step after step {WARM_UP_STEPS} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, records in results.items():
        row = summarize(name, records)
        for key, process in (("perf/worker_rss_gb", "worker"), ("perf/driver_rss_gb", "driver")):
            v = row[key]
            print(
                f"| {name} | {process} | {v['step 1']:.3f} | {v[f'step {WARM_UP_STEPS}']:.3f} | {v['last']:.3f} | "
                f"{v['MB/step after warm-up']:+.2f} |"
            )
    ours = [(name, records) for name, records in results.items() if ", cache" not in name]  # not the baselines
    worst = max(abs(summarize(name, records)["perf/worker_rss_gb"]["MB/step after warm-up"]) for name, records in ours)
    verdict = "met" if worst < GOAL_MB_PER_STEP else "NOT met"
    print(f"\ngoal: under {GOAL_MB_PER_STEP} MB per step after step {WARM_UP_STEPS} (workers): {verdict}")
    plot(results, args.out)


if __name__ == "__main__":
    main()
