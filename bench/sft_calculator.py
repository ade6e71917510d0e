"""SFT as the warm start of RL on the calculator task (run by hand, not a test): held-out accuracy before SFT, after
SFT, and after GRPO from the SFT model against GRPO from the base model at equal steps.

    .venv/bin/python bench/sft_calculator.py                         # ~50 min on 2 cores
    .venv/bin/python bench/sft_calculator.py --sft-steps 8 --grpo-steps 4    # a quick look

1. The calculator task (`python -m hybridflow.data.tasks calculator --gold`): train rows with their gold
   conversations (the tool call, the tool's message, the answer), 60 held-out test rows.
2. `hybridflow sft` of SmolLM2-135M-Instruct on the first `--sft-steps` x 16 gold conversations
   (examples/sft_calculator_smollm2.yaml), then `hybridflow export` of its last checkpoint.
3. `hybridflow train --config examples/grpo_calculator_smollm2.yaml` for `--grpo-steps` steps twice: from the
   base model and from the SFT model, on the same prompts and seed. Their validation before training is the
   accuracy before and after SFT; the later ones, GRPO's.

Prints a table, writes --out/results.json and a plot (--plot, by default docs/images/sft_calculator.png).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SFT_CONFIG = REPO / "examples" / "sft_calculator_smollm2.yaml"
GRPO_CONFIG = REPO / "examples" / "grpo_calculator_smollm2.yaml"
VAL_KEY = "val/score/mean"  # greedy, the 60 held-out questions
TRAIN_KEY = "critic/score/mean"  # the step's 128 sampled conversations (temperature 1)


def run(command: list[str]) -> None:
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"failed (exit {done.returncode}): {' '.join(command)}")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_step(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10.0, 4.0), dpi=110)
    lines = (("grpo_from_base", "GRPO from the base model", "o--"), ("grpo_from_sft", "GRPO from the SFT model", "s-"))
    panels = (
        ("accuracy", "held-out accuracy (60 questions, greedy)"),
        ("reward", "training reward (128 samples, T=1)"),
    )
    for ax, (kind, ylabel) in zip(axes, panels, strict=True):
        for name, label, style in lines:
            values = results[name][kind]
            steps = sorted(values, key=int)
            # a step's reward scores its own samples, drawn before its update: the policy after step - 1 updates
            done = [int(s) - (kind == "reward") for s in steps]
            ax.plot(done, [values[s] for s in steps], style, label=label)
        ax.set_xlabel("GRPO updates done")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    figure.suptitle(f"Calculator task, SmolLM2-135M-Instruct: SFT ({results['sft_steps']} steps) as the warm start")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=32, help="SFT steps of 16 gold conversations each")
    parser.add_argument("--grpo-steps", type=int, default=10, help="GRPO steps of each run")
    parser.add_argument("--test-freq", type=int, default=1, help="GRPO steps between held-out validations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sft_calculator")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "images" / "sft_calculator.png")
    parser.add_argument("--report-only", action="store_true", help="summarise the runs already in --out")
    args = parser.parse_args()
    data, python = args.out / "data", sys.executable
    runs = {name: args.out / name for name in ("sft", "grpo_from_base", "grpo_from_sft")}
    model = args.out / "sft_model"
    common = ["trainer.logger=[jsonl]", "trainer.resume_mode=disable", f"trainer.seed={args.seed}"]
    if not args.report_only:
        tasks = [python, "-m", "hybridflow.data.tasks", "calculator", "--out", str(data)]
        run([*tasks, "--train", "2000", "--test", "60", "--gold"])
        run(
            [python, "-m", "hybridflow.cli", "sft", "--config", str(SFT_CONFIG), *common,
             f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]",
             f"trainer.total_training_steps={args.sft_steps}", f"trainer.save_freq={args.sft_steps}",
             f"trainer.default_local_dir={runs['sft']}"]
        )  # fmt: skip
        run([python, "-m", "hybridflow.cli", "export", str(runs["sft"]), str(model)])
        for name, path in (("grpo_from_base", "smollm2-135m-instruct"), ("grpo_from_sft", str(model))):
            run(
                [python, "-m", "hybridflow.cli", "train", "--config", str(GRPO_CONFIG), *common,
                 f"actor_rollout_ref.model.path={path}", f"data.train_files=[{data / 'train.parquet'}]",
                 f"data.val_files=[{data / 'test.parquet'}]", f"trainer.total_training_steps={args.grpo_steps}",
                 f"trainer.test_freq={args.test_freq}", f"trainer.default_local_dir={runs[name]}"]
            )  # fmt: skip
    sft_losses = [r for r in records(runs["sft"]) if "val/loss" in r]
    results = {
        "sft_steps": args.sft_steps,
        "sft_val_loss": {r["step"]: r["val/loss"] for r in sft_losses},
    }
    for name in ("grpo_from_base", "grpo_from_sft"):
        results[name] = {"accuracy": by_step(runs[name], VAL_KEY), "reward": by_step(runs[name], TRAIN_KEY)}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    base, warm = results["grpo_from_base"]["accuracy"], results["grpo_from_sft"]["accuracy"]
    last = max(base)
    print("| model | held-out accuracy |\n| --- | --- |")
    print(f"| SmolLM2-135M-Instruct (before SFT) | {base[0]:.2f} |")
    print(f"| after SFT ({args.sft_steps} steps) | {warm[0]:.2f} |")
    print(f"| GRPO from the base model, {last} steps | {base[last]:.2f} |")
    print(f"| GRPO from the SFT model, {last} steps | {warm[last]:.2f} |")
    for name in ("grpo_from_base", "grpo_from_sft"):
        row = results[name]
        print(f"{name}: step, held-out accuracy, training reward:")
        print(
            "  "
            + "  ".join(
                f"{s}: {row['accuracy'].get(s, float('nan')):.2f} / {row['reward'].get(s, float('nan')):.2f}"
                for s in sorted(row["accuracy"])
            )
        )
    plot(results, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
