"""PPO with a critic, a reference and a reward model under each placement (run by hand, not a test).

    .venv/bin/python bench/placement.py                      # smollm2-135m, 3 steps per placement
    .venv/bin/python bench/placement.py --model tiny-llama --steps 4 --response-length 16
    .venv/bin/python bench/placement.py --threads 1 --plots docs/images   # also each placement's Gantt chart

One invocation runs the same PPO job (GAE, KL loss against the reference, a reward model, the
arithmetic task; one rank per pool, ``--threads`` torch threads per rank) under ``all_colocate``,
``group_colocate`` and ``separate`` as real ``hybridflow train`` runs on a local Ray cluster, and
prints seconds per step and per stage side by side (the median over the steps after the first), the
time pools spent working at once (from timeline.jsonl), and each step time as a ratio to
all_colocate's from the same invocation.

It also predicts the placements on a machine with one device per role (4), split evenly over each
placement's pools, from all_colocate's per-stage times (each stage measured alone on one device):
the step's critical path through the dataflow, the stages of one pool in series and different
pools in parallel, once with perfect data-parallel scaling and once with none (the two bounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from hybridflow.data.tasks import write_task
from hybridflow.report.timeline import draw_timeline
from hybridflow.run_files import Span

PLACEMENTS = ("all_colocate", "group_colocate", "separate")
STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "rm", "adv", "update_critic", "update_actor")
# the pools of each preset, as the stages they run (the driver's stages run on neither)
POOLS = {
    "all_colocate": [("gen", "old_log_prob", "ref", "values", "rm", "update_critic", "update_actor")],
    "group_colocate": [("gen", "old_log_prob", "ref", "update_actor"), ("values", "rm", "update_critic")],
    "separate": [("gen", "old_log_prob", "update_actor"), ("ref",), ("values", "update_critic"), ("rm",)],
}
# the dataflow's phases: generation; everything that reads only the responses; the driver; the updates
PHASES = (("gen",), ("old_log_prob", "ref", "values", "rm", "reward"), ("adv",), ("update_critic", "update_actor"))


def run(placement: str, args: argparse.Namespace, data: Path, run_dir: Path) -> tuple[list[dict], list[dict]]:
    overrides = [
        f"data.train_files=[{data / 'train.parquet'}]",
        "data.val_files=[]",
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.model.path={args.model}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.rollout.response_length={args.response_length}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.adv_estimator=gae",
        f"critic.ppo_mini_batch_size={args.prompts}",
        "reward_model.enable=true",
        f"reward_model.model.path={args.model}",
        f"trainer.placement={placement}",
        "trainer.n_workers_per_node=1",
        f"trainer.cpus_per_worker={args.threads}",
        "trainer.val_before_train=false",
        "trainer.total_epochs=100",
        f"trainer.total_training_steps={args.steps}",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
    ]
    print(f"{placement}: {args.steps} steps ...", flush=True)
    subprocess.run(
        [sys.executable, "-m", "hybridflow.trainer.commands.train", *overrides], check=True, stdout=subprocess.DEVNULL
    )
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    spans = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    return metrics, spans


def overlap_seconds(spans: list[dict]) -> float:
    """Time during which at least two different worker pools were busy at once."""
    events = []
    for span in spans:
        if span["lane"] != "driver":
            events += [(span["start"], 1, span["lane"]), (span["end"], -1, span["lane"])]
    busy: dict[str, int] = defaultdict(int)
    total, last = 0.0, None
    for time, change, lane in sorted(events):
        if last is not None and sum(1 for count in busy.values() if count > 0) >= 2:
            total += time - last
        busy[lane] += change
        last = time
    return total


def predicted_step(stage_seconds: dict[str, float], pools: list[tuple[str, ...]], devices: int, scaling: bool) -> float:
    """A step's critical path on ``devices`` devices split evenly over ``pools``: per phase, the busiest
    pool (its stages in series) or the driver. ``scaling``: a stage on d devices takes 1/d of its
    one-device time (perfect data parallelism); otherwise it takes the same time on any number."""
    per_pool = devices / len(pools)
    total = 0.0
    for phase in PHASES:
        on_pools = [sum(stage_seconds.get(s, 0.0) for s in phase if s in pool) for pool in pools]
        if scaling:
            on_pools = [seconds / per_pool for seconds in on_pools]
        driver = sum(stage_seconds.get(s, 0.0) for s in phase if not any(s in pool for pool in pools))
        total += max([*on_pools, driver])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and CPUs reserved) per rank")
    parser.add_argument("--plots", type=Path, default=None, help="write each placement's last-step Gantt chart here")
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min load average, {os.cpu_count()} cores)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_task("arithmetic", data, train=256, test=8, seed=0)
        for placement in PLACEMENTS:
            results[placement] = run(placement, args, data, Path(tmp) / placement)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
        for placement, (_, spans) in results.items():
            last = [Span(**s) for s in spans if s["step"] == args.steps]
            draw_timeline(last, args.plots / f"placement_{placement}_t{args.threads}.png")

    measured = {}
    for placement, (metrics, spans) in results.items():
        later = metrics[1:] or metrics  # the first step warms caches up
        measured[placement] = {
            key: statistics.median(r.get(f"timing_s/{key}", 0.0) for r in later) for key in ("step", *STAGES)
        }
        later_steps = {r["step"] for r in later}
        step_spans = [s for s in spans if s["step"] in later_steps]
        measured[placement]["overlap"] = overlap_seconds(step_spans) / len(later_steps)

    base = measured["all_colocate"]["step"]
    width = 16
    print(f"\n{args.model}, {args.prompts} prompts x 2 samples, {args.response_length} tokens, one rank per pool")
    print("seconds per step (median of steps 2..N)".ljust(26) + "".join(p.rjust(width) for p in PLACEMENTS))
    for key in ("step", *STAGES, "overlap"):
        print(f"  {key:<24}" + "".join(f"{measured[p][key]:{width}.2f}" for p in PLACEMENTS))
    print("  step / all_colocate".ljust(26) + "".join(f"{measured[p]['step'] / base:{width}.2f}" for p in PLACEMENTS))
    devices = len(POOLS["separate"])
    for scaling, label in ((True, "linear data-parallel scaling"), (False, "no scaling with devices")):
        predicted = {p: predicted_step(measured["all_colocate"], POOLS[p], devices, scaling) for p in PLACEMENTS}
        print(f"predicted on {devices} devices split evenly over the pools ({label}), from all_colocate's stage times:")
        print("  step".ljust(26) + "".join(f"{predicted[p]:{width}.2f}" for p in PLACEMENTS))
        ratios = [predicted[p] / predicted["all_colocate"] for p in PLACEMENTS]
        print("  step / all_colocate".ljust(26) + "".join(f"{r:{width}.2f}" for r in ratios))


if __name__ == "__main__":
    main()
