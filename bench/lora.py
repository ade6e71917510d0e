"""Full fine-tuning against LoRA at a few ranks on the demo (SmolLM2-135M-Instruct, GRPO, arithmetic), side by side
in one invocation (run by hand, not a test).

    .venv/bin/python bench/lora.py --steps 3 --no-validation          # the costs only: a few minutes a run
    .venv/bin/python bench/lora.py --seeds 0 1 2 --ranks 8 32         # the demo's 30 steps: the learning too

Every run is the demo's own job (examples/grpo_arithmetic_smollm2.yaml: 2 workers on a local Ray cluster, the
hybrid actor) with a checkpoint after its last step; ``full`` trains every weight at the example's learning rate,
``lora_r<R>`` adapters of rank R on every linear layer (alpha ``--alpha``, learning rate ``--lora-lr``). Per run:
the workers' peak memory (``perf/max_memory_gb``) and resident set, the median step, generation and update
seconds (steps after the first), what the switch to generation gave the rollout at the first step and after it
(MB, seconds), the checkpoint's size on disk, and the held-out accuracy at each validation. Then each LoRA rank
against ``full`` over the seeds both ran. Runs go to --out (one folder each; --report-only summarises them again).
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

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "grpo_arithmetic_smollm2.yaml"


def variant_overrides(variant: str, args: argparse.Namespace) -> list[str]:
    if variant == "full":
        return []
    rank = int(variant.removeprefix("lora_r"))
    return [
        f"actor_rollout_ref.model.lora.rank={rank}",
        f"actor_rollout_ref.model.lora.alpha={args.alpha}",
        f"actor_rollout_ref.actor.optim.lr={args.lora_lr}",
    ]


def run(args: argparse.Namespace, variant: str, seed: int, data: Path, run_dir: Path) -> list[dict]:
    overrides = [
        "--config",
        str(CONFIG),
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'test.parquet'}]" if not args.no_validation else "data.val_files=[]",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.save_freq={args.steps}",
        f"trainer.seed={seed}",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
        *(["trainer.val_before_train=false"] if args.no_validation else []),
        *variant_overrides(variant, args),
        *args.set,
    ]
    print(f"{variant}, seed {seed}: {run_dir}", flush=True)
    if not args.report_only:
        done = subprocess.run([sys.executable, "-m", "hybridflow.trainer.commands.train", *overrides], cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"the {variant} run (seed {seed}) failed with exit code {done.returncode}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def directory_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def summarise(records: list[dict], variant: str, seed: int, run_dir: Path) -> dict:
    steps = sorted((r for r in records if "timing_s/step" in r), key=lambda r: r["step"])
    later = steps[1:] or steps

    def median(key: str) -> float:
        return statistics.median(r[key] for r in later)

    checkpoints = sorted(run_dir.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    return {
        "variant": variant,
        "seed": seed,
        "accuracy": {r["step"]: r["val/score/mean"] for r in records if "val/score/mean" in r},
        "step_s": median("timing_s/step"),
        "gen_s": median("timing_s/gen"),
        "update_s": median("timing_s/update_actor"),
        "peak_gb": max(r["perf/max_memory_gb"] for r in steps),
        "rss_gb": max(r["perf/worker_rss_gb"] for r in steps),
        "first_sync_mb": steps[0]["switch/generation_weights_mb"],
        "first_sync_s": steps[0]["timing_s/weight_sync"],
        "sync_mb": median("switch/generation_weights_mb"),
        "sync_s": median("timing_s/weight_sync"),
        "checkpoint_mb": directory_mb(checkpoints[-1] / "actor") if checkpoints else float("nan"),
    }


def table(results: list[dict]) -> str:
    validated = sorted({int(step) for r in results for step in r["accuracy"]})
    head = (
        "| run | seed | peak GB | RSS GB | step s | gen s | update s | 1st sync MB (s) | sync MB (s) | checkpoint MB |"
        + "".join(f" acc@{s} |" for s in validated)
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in results:
        accuracy = {int(k): v for k, v in r["accuracy"].items()}
        lines.append(
            f"| {r['variant']} | {r['seed']} | {r['peak_gb']:.2f} | {r['rss_gb']:.2f} | {r['step_s']:.1f} | "
            f"{r['gen_s']:.1f} | {r['update_s']:.1f} | {r['first_sync_mb']:.1f} ({r['first_sync_s']:.2f}) | "
            f"{r['sync_mb']:.2f} ({r['sync_s']:.3f}) | {r['checkpoint_mb']:.1f} |"
            + "".join(f" {accuracy.get(s, float('nan')):.2f} |" for s in validated)
        )
    return "\n".join(lines)


def ratios(results: list[dict]) -> str:
    """Each LoRA run against ``full`` of the same seed: step time, peak memory, sync bytes, checkpoint size."""
    full = {r["seed"]: r for r in results if r["variant"] == "full"}
    lines = []
    for variant in sorted({r["variant"] for r in results} - {"full"}):
        mine = [r for r in results if r["variant"] == variant and r["seed"] in full]
        if not mine:
            continue
        parts = []
        for key in ("step_s", "update_s", "gen_s", "peak_gb", "sync_mb", "checkpoint_mb"):
            parts.append(f"{key} {statistics.mean(r[key] / full[r['seed']][key] for r in mine):.3f}")
        finals = [list(r["accuracy"].values())[-1] for r in mine if r["accuracy"]]
        full_finals = [list(full[r["seed"]]["accuracy"].values())[-1] for r in mine if r["accuracy"]]
        if finals:
            parts.append(f"final accuracy {statistics.mean(finals):.3f} (full {statistics.mean(full_finals):.3f})")
        lines.append(f"{variant} / full over seeds {sorted(r['seed'] for r in mine)}: " + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha of every rank (scaling alpha / rank)")
    parser.add_argument("--lora-lr", type=float, default=1e-4, help="the LoRA runs' learning rate")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-validation", action="store_true", help="costs only: no held-out evaluation")
    parser.add_argument("--skip-full", action="store_true", help="LoRA runs only (full runs already in --out)")
    parser.add_argument("--set", nargs="*", default=[], help="more key=value overrides for every run")
    parser.add_argument("--report-only", action="store_true", help="summarise the runs already in --out")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora")
    args = parser.parse_args()
    data = args.out / "data"
    if not (data / "train.parquet").is_file():
        write_task("arithmetic", data, train=2000, test=100, seed=0)  # the demo's data (make demo)
    variants = ([] if args.skip_full else ["full"]) + [f"lora_r{rank}" for rank in args.ranks]
    results, start = [], time.time()
    for seed in args.seeds:
        for variant in variants:
            run_dir = args.out / f"{variant}_seed{seed}"
            results.append(summarise(run(args, variant, seed, data, run_dir), variant, seed, run_dir))
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if args.skip_full:  # the full runs of an earlier invocation, for the ratios
        for seed in args.seeds:
            run_dir = args.out / f"full_seed{seed}"
            if (run_dir / "metrics.jsonl").is_file():
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                results.append(summarise(records, "full", seed, run_dir))
    print(table(results))
    print(ratios(results))
    print(f"{len(results)} runs in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
