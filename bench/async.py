"""Asynchronous training (one step off policy, fully asynchronous) against synchronous training on the same cores
(run by hand, not a test).

    .venv/bin/python bench/async.py demo --seeds 0 1 2                  # the demo's job, 30 steps per run
    .venv/bin/python bench/async.py calculator --tool-delay-s 1 --steps 12
    .venv/bin/python bench/async.py demo --steps 4 --set actor_rollout_ref.rollout.response_length=256

Each (seed, mode) is a real `hybridflow train` run on a local Ray cluster of --workers CPU workers:

- ``sync``: today's loop, every worker data-parallel, generating then training (`trainer.n_workers_per_node`
  = --workers, one pool);
- ``one_step_off``: half the workers generate (pool `rollout`), half train (pool `actor`), the batch of step
  k+1 generated while step k trains, with the decoupled objective (`algorithm.rollout_correction.rollout_is=
  token`);
- ``one_step_off_rollout_log_probs`` (not run unless named in --modes): the same schedule with the cheap
  correction, the rollout's log-probs as PPO's old policy (`rollout.old_log_prob_source=rollout`).
- ``fully_async`` and ``fully_async_eta4`` (not run unless named in --modes): the same two pools, the rollout
  generating continuously into a queue at most 1 (4) policy versions ahead of the trainer
  (`trainer.async_training.max_staleness`), weights pushed every step, the decoupled objective;
  ``fully_async_partial``: η = 1 with partial rollout (a push cuts the call in flight short; single-turn
  workloads: demo, countdown); ``fully_async_shared_cores``: η = 1 with both pools' ranks running --workers
  torch threads each, sharing all the cores instead of one each.

It prints, per mode and seed, the held-out accuracy at each validation, seconds per step (the median after
the first), samples per second (all the run's samples over the sum of its steps' times: validation and
checkpoints left out, the same in both modes), response tokens per second (the same, in generated tokens:
the fairer measure where the two modes' samples differ in length) and the training time until the held-out
accuracy first reached --target; then the ratios of each asynchronous mode to sync over the same seeds of
this invocation. It writes results.json, results.md and each mode's Gantt chart of its median step (seed of
the first run) into --out; --report-only summarises the runs already there again.

Workloads: ``demo`` (examples/grpo_arithmetic_smollm2.yaml: 16 prompts x 4 samples of up to 32 tokens),
``calculator`` (examples/grpo_calculator_smollm2.yaml, multi-turn with the calculator tool, whose every call
waits --tool-delay-s first: a tool that takes time, as a search or a test run does) and ``countdown`` (the
demo's settings on the countdown task, whose answers the model writes out at length: set the response length
with --set). --set adds overrides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hybridflow.data.tasks import write_task
from hybridflow.report.timeline import draw_timeline
from hybridflow.run_files import Span

ROOT = Path(__file__).resolve().parent.parent


def fully_async(workers: int, max_staleness: int) -> list[str]:
    return [
        "trainer.async_training.mode=fully_async",
        f"trainer.async_training.max_staleness={max_staleness}",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=group_colocate",
        f"trainer.n_workers_per_node={workers // 2}",
    ]


MODES = {
    "sync": lambda workers: [f"trainer.n_workers_per_node={workers}"],
    "one_step_off": lambda workers: [
        "trainer.async_training.mode=one_step_off",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=group_colocate",
        f"trainer.n_workers_per_node={workers // 2}",
    ],
    # the cheap option: the rollout's log-probs are PPO's old policy, no proximal pass on the actor
    "one_step_off_rollout_log_probs": lambda workers: [
        "trainer.async_training.mode=one_step_off",
        "actor_rollout_ref.rollout.old_log_prob_source=rollout",
        "trainer.placement=group_colocate",
        f"trainer.n_workers_per_node={workers // 2}",
    ],
    # the rollout generates continuously into a queue, at most η policy versions ahead (trainer/loop/async_queue.py)
    "fully_async": lambda workers: fully_async(workers, max_staleness=1),
    "fully_async_eta4": lambda workers: fully_async(workers, max_staleness=4),
    # the same with partial rollout: a push cuts the call in flight short, its samples go on under the new weights
    "fully_async_partial": lambda workers: [
        *fully_async(workers, max_staleness=1),
        "trainer.async_training.partial_rollout=true",
    ],
    # η = 1 with each pool's rank free to use every core (torch threads = --workers): the OS hands the trainer the
    # cores that generation leaves idle (waiting on a tool, between calls) instead of fixing one core per pool
    "fully_async_shared_cores": lambda workers: [
        *fully_async(workers, max_staleness=1),
        f"trainer.threads_per_worker={workers}",
    ],
}
WORKLOADS = {  # name: (config file, task, held-out questions)
    "demo": ("examples/grpo_arithmetic_smollm2.yaml", "arithmetic", 100),
    "calculator": ("examples/grpo_calculator_smollm2.yaml", "calculator", 60),
    "countdown": ("examples/grpo_arithmetic_smollm2.yaml", "countdown", 50),  # long answers: set the length
}
SLOW_TOOL = '''
import asyncio

from hybridflow.tools.calculator import CalculatorTool


class SlowCalculator(CalculatorTool):
    """The calculator, each call waiting ``delay_s`` first (a tool that takes time: a search, a test run)."""

    def __init__(self, delay_s: float = 1.0):
        super().__init__()
        self.delay_s = delay_s

    async def execute(self, instance_id, arguments):
        await asyncio.sleep(self.delay_s)
        return await super().execute(instance_id, arguments)
'''


def workload_overrides(args: argparse.Namespace, out: Path) -> list[str]:
    config, task, test = WORKLOADS[args.workload]
    data = out / "data"
    if not (data / "train.parquet").is_file():
        write_task(task, data, train=2000, test=test, seed=0)
    overrides = [
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'test.parquet'}]",
        "trainer.logger=[jsonl]",
        "trainer.save_freq=-1",
    ]
    if args.steps:
        overrides.append(f"trainer.total_training_steps={args.steps}")
    if args.test_freq:
        overrides.append(f"trainer.test_freq={args.test_freq}")
    if args.workload == "calculator":
        (out / "slow_tool.py").write_text(SLOW_TOOL)
        tools = out / "tools.yaml"
        tool = f"  - class: {out / 'slow_tool.py'}:SlowCalculator\n    config: {{delay_s: {args.tool_delay_s}}}\n"
        tools.write_text(f"tools:\n{tool}")
        overrides.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}")
    return ["--config", str(ROOT / config), *overrides, *args.set]


def run(args: argparse.Namespace, base: list[str], mode: str, seed: int, run_dir: Path) -> dict:
    overrides = [*base, *MODES[mode](args.workers), f"trainer.seed={seed}", f"trainer.default_local_dir={run_dir}"]
    print(f"{mode}, seed {seed}: {run_dir}", flush=True)
    start = time.time()
    if not args.report_only:
        done = subprocess.run([sys.executable, "-m", "hybridflow.trainer.commands.train", *overrides], cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"the {mode} run (seed {seed}) failed with exit code {done.returncode}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summarise(records, mode, seed, args, wall_s=time.time() - start)


def summarise(records: list[dict], mode: str, seed: int, args: argparse.Namespace, wall_s: float) -> dict:
    """What one run measured: accuracy per validated step, step times, samples per second, time to target."""
    steps = [r for r in records if "timing_s/step" in r]
    elapsed, accuracy, reached = 0.0, {}, None
    for record in sorted(records, key=lambda r: r["step"]):
        elapsed += record.get("timing_s/step", 0.0)
        if "val/score/mean" in record:
            accuracy[record["step"]] = record["val/score/mean"]
            if reached is None and record["val/score/mean"] >= args.target:
                reached = elapsed
    samples = len(steps) * args.samples_per_step
    tokens = sum(r["response_length/mean"] for r in steps) * args.samples_per_step
    times = [r["timing_s/step"] for r in steps]
    return {
        "mode": mode,
        "seed": seed,
        "accuracy": accuracy,
        "median_step_s": statistics.median(times[1:] or times),
        "train_s": sum(times),
        "samples_per_s": samples / sum(times),
        "response_tokens_per_s": tokens / sum(times),  # where response lengths differ between the runs
        "time_to_target_s": reached,
        "wall_s": wall_s,
        "gen_s": statistics.median(r.get("timing_s/gen", 0.0) for r in steps[1:] or steps),
        "update_s": statistics.median(r.get("timing_s/update_actor", 0.0) for r in steps[1:] or steps),
        "trainer_wait_s": statistics.median(r.get("async/trainer_wait_s", 0.0) for r in steps[1:] or steps),
        "transfer_s": statistics.median(r.get("transfer/seconds", 0.0) for r in steps[1:] or steps),
    }


def gantt(run_dir: Path, result: dict, path: Path) -> None:
    """The run's median step (by time) as a Gantt chart."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r["timing_s/step"], r["step"]) for r in records if "timing_s/step" in r and r["step"] > 1)
    if not steps:
        return
    step = steps[len(steps) // 2][1]
    spans = [Span(**json.loads(line)) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    draw_timeline([s for s in spans if s.step == step], path, steps=[step])
    result["gantt"] = str(path)


def table(results: list[dict], args: argparse.Namespace) -> str:
    validated = sorted({int(step) for r in results for step in r["accuracy"]})
    head = "| mode | seed | " + " | ".join(f"acc @{s}" for s in validated)
    head += f" | s/step | samples/s | tokens/s | s to acc >= {args.target} |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in results:
        acc = " | ".join(f"{r['accuracy'].get(s, r['accuracy'].get(str(s), float('nan'))):.2f}" for s in validated)
        reached = f"{r['time_to_target_s']:.0f}" if r["time_to_target_s"] is not None else "not reached"
        speed = f"{r['median_step_s']:.1f} | {r['samples_per_s']:.2f} | {r['response_tokens_per_s']:.1f}"
        lines.append(f"| {r['mode']} | {r['seed']} | {acc} | {speed} | {reached} |")
    return "\n".join(lines)


def ratios(results: list[dict]) -> str:
    """Each asynchronous mode against ``sync`` on the seeds both ran, and each mode's final accuracy."""
    by = {(r["mode"], r["seed"]): r for r in results}
    modes = list(dict.fromkeys(r["mode"] for r in results))
    lines = []
    for mode in [m for m in modes if m != "sync"]:
        seeds = sorted({s for m, s in by if m == mode and ("sync", s) in by})
        for key, name in [
            ("samples_per_s", "samples per second"),
            ("response_tokens_per_s", "response tokens per second"),
            ("median_step_s", "seconds per step"),
        ]:
            values = [by[mode, s][key] / by["sync", s][key] for s in seeds]
            lines.append(f"{mode} / sync, {name}: " + ", ".join(f"{v:.2f}" for v in values))
        both = [s for s in seeds if by["sync", s]["time_to_target_s"] and by[mode, s]["time_to_target_s"]]
        if both:
            values = [by[mode, s]["time_to_target_s"] / by["sync", s]["time_to_target_s"] for s in both]
            lines.append(f"{mode} / sync, time to the target accuracy: " + ", ".join(f"{v:.2f}" for v in values))
    for mode in modes:
        seeds = sorted(s for m, s in by if m == mode)
        final = [list(by[mode, s]["accuracy"].values())[-1] for s in seeds]
        lines.append(f"{mode}: final held-out accuracy mean {statistics.mean(final):.3f} over seeds {seeds}: {final}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["sync", "one_step_off"])
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: the workload's config)")
    parser.add_argument("--test-freq", type=int, default=0, help="validate every N steps (default: the config's)")
    parser.add_argument("--workers", type=int, default=2, help="CPU workers in all (one_step_off: half each)")
    parser.add_argument("--target", type=float, default=0.55, help="held-out accuracy for the time-to-accuracy")
    parser.add_argument("--tool-delay-s", type=float, default=1.0, help="calculator: seconds each tool call waits")
    parser.add_argument("--set", nargs="*", default=[], help="more key=value overrides for every run")
    parser.add_argument("--report-only", action="store_true", help="summarise the runs already in --out")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/async_<workload>")
    args = parser.parse_args()
    out = (args.out or ROOT / "bench" / "results" / f"async_{args.workload}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = workload_overrides(args, out)
    args.samples_per_step = samples_per_step(base)
    results = []
    for seed in args.seeds:
        for mode in args.modes:
            run_dir = out / f"{mode}_seed{seed}"
            result = run(args, base, mode, seed, run_dir)
            if seed == args.seeds[0]:
                gantt(run_dir, result, out / f"gantt_{mode}.png")
            results.append(result)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            print(table(results, args), flush=True)
    report = f"{table(results, args)}\n\n{ratios(results)}\n"
    (out / "results.md").write_text(report)
    print(report)


def samples_per_step(overrides: list[str]) -> int:
    """Prompts x samples per prompt of the runs (the config file's, unless overridden)."""
    from hybridflow.trainer.setup.config import load_config

    config = load_config(overrides[2:], overrides[1])  # after "--config FILE"
    return config.data.train_batch_size * config.actor_rollout_ref.rollout.n


if __name__ == "__main__":
    main()
