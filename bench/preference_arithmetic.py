"""The preference pipeline on the built-in arithmetic task, end to end (docs/preference.md, "Results"), run by hand:

    .venv/bin/python bench/preference_arithmetic.py [--seeds 0 1] [--stages measure dpo rm grpo]

Its pairs are SmolLM2-135M-Instruct's own sampled answers, a right one chosen over a wrong one
(``hybridflow distill-data --format pairs``; the commands are in examples/dpo_arithmetic_smollm2.yaml), in
data/arithmetic_pairs/{train,test}.parquet. Then, each stage a real run of the commands a user types:

- ``measure``: the starting model's greedy held-out accuracy (``hybridflow measure``, the 100 test prompts);
- ``dpo``: ``hybridflow dpo`` (examples/dpo_arithmetic_smollm2.yaml) per seed, exported and measured the same way;
- ``rm``: ``hybridflow rm`` (examples/rm_arithmetic_smollm2.yaml) per seed: the held-out pairs' accuracy; the first
  seed's model exported for the next stage;
- ``grpo``: GRPO with that reward model instead of the rule (examples/grpo_arithmetic_rm_smollm2.yaml), first seed:
  its held-out accuracy by the rule at each validation, to compare with the rule-reward demo's.

Runs go under --out (a finished one is not run again); results.json and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
TEST = REPO / "data" / "arithmetic" / "test.parquet"


def hybridflow(*args: str) -> str:
    """A hybridflow command's output (it must succeed), shown as it runs."""
    print("$ hybridflow " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-2000:], done.stderr[-3000:] if done.returncode else "", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"hybridflow {args[0]} failed (exit {done.returncode})")
    return done.stdout


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def accuracy(model: str) -> float:
    """Greedy accuracy on the 100 held-out prompts (the demo's validation set), fp32."""
    out = hybridflow(
        "measure", "--data", str(TEST), "--n", "100", "--dtype", "float32", "--model", model, "--show", "0"
    )
    return float(re.search(r"accuracy of .*?: ([0-9.]+)", out).group(1))


def trained(command: str, config: str, run_dir: Path, seed: int, *extra: str) -> tuple[Path, float]:
    """The run (skipped when its checkpoint exists), exported; the exported directory and the run's seconds."""
    model_dir = run_dir.with_name(run_dir.name + "_model")
    start = time.time()
    if not (model_dir / "config.json").is_file():
        overrides = [f"trainer.seed={seed}", f"trainer.default_local_dir={run_dir}", "trainer.save_freq=1000"]
        overrides.append("trainer.max_ckpt_to_keep=1")
        hybridflow(command, "--config", config, *overrides, "trainer.logger=[console,jsonl]", *extra)
        hybridflow("export", str(run_dir), str(model_dir))
    return model_dir, time.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--stages", nargs="+", default=["measure", "dpo", "rm", "grpo"])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "preference_arithmetic")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}

    def save() -> None:
        results_file.write_text(json.dumps(results, indent=1))

    if "measure" in args.stages:
        results["base_accuracy"] = accuracy(MODEL)
        save()
    if "dpo" in args.stages:
        for seed in args.seeds:
            run_dir = args.out / f"dpo_s{seed}"
            model_dir, seconds = trained("dpo", "examples/dpo_arithmetic_smollm2.yaml", run_dir, seed)
            last = records(run_dir)[-1]
            results[f"dpo_s{seed}"] = {
                "accuracy": accuracy(str(model_dir)),
                "val_reward_accuracy": last["val/dpo/reward_accuracy"],
                "val_loss": last["val/dpo/loss"],
                "seconds": seconds,
            }
            save()
    if "rm" in args.stages:
        for seed in args.seeds:
            run_dir = args.out / f"rm_s{seed}"
            _, seconds = trained("rm", "examples/rm_arithmetic_smollm2.yaml", run_dir, seed)
            history = [r for r in records(run_dir) if "val/rm/accuracy" in r]
            results[f"rm_s{seed}"] = {
                "val_accuracy": history[-1]["val/rm/accuracy"],
                "val_loss": history[-1]["val/rm/loss"],
                "curve": [(r["step"], r["val/rm/accuracy"]) for r in history],
                "seconds": seconds,
            }
            save()
    if "grpo" in args.stages:
        seed = args.seeds[0]
        reward_model = args.out / f"rm_s{seed}_model"
        run_dir = args.out / f"grpo_rm_s{seed}"
        if not (run_dir / "metrics.jsonl").is_file() or len(records(run_dir)) < 31:
            hybridflow(
                "train",
                "--config",
                "examples/grpo_arithmetic_rm_smollm2.yaml",
                f"reward_model.model.path={reward_model}",
                f"trainer.seed={seed}",
                f"trainer.default_local_dir={run_dir}",
            )
        results[f"grpo_rm_s{seed}"] = {
            "curve": [
                (r["step"], r["val/arithmetic/score_mean"])
                for r in records(run_dir)
                if "val/arithmetic/score_mean" in r
            ],
            "rule_score": [(r["step"], r["reward/rule_score"]) for r in records(run_dir) if "reward/rule_score" in r],
            "step_s": sorted(r["timing_s/step"] for r in records(run_dir) if "timing_s/step" in r),
        }
        save()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
