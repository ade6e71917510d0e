"""Does an agent trained through the endpoint learn as the in-process agent loop does? The calculator task, GRPO on
SmolLM2, the same steps and seeds both ways (run by hand, not a test; on the Intel/AMX host a step of the examples'
16 prompts x 8 samples took 5 minutes, most of it the actor update, hence --batch).

    .venv/bin/python bench/agent_learning.py --seeds 0 1 --steps 5 --batch 4 --out /tmp/agent_learning

  in-process  examples/grpo_calculator_smollm2.yaml: the `tool_agent` loop with the calculator tool
  endpoint    examples/grpo_calculator_agent_smollm2.yaml: examples/agents/calculator_openai.py, an openai-SDK
              agent with the same calculator and scorer, through the run's OpenAI-compatible endpoint

The endpoint describes the tool in the system message (its fallback format, SmolLM2's template having none), so
the in-process run's data gets the same text appended to its system messages: both models see the same prompt
tokens. Held-out accuracy (val/score/mean, 60 questions, greedy) before training and every --test-freq steps is
printed as a table per seed and drawn in --plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "agents"))
from calculator_openai import CALCULATOR  # noqa: E402

from hybridflow.rollout.agent_server.rendering import tools_text  # noqa: E402

SIDES = {
    "in-process": ROOT / "examples" / "grpo_calculator_smollm2.yaml",
    "endpoint": ROOT / "examples" / "grpo_calculator_agent_smollm2.yaml",
}


def make_data(out: Path) -> dict[str, Path]:
    """The calculator data, and a copy whose system messages end with the endpoint's description of the tool."""
    plain = out / "data" / "calculator"
    if not (plain / "test.parquet").exists():
        subprocess.run(
            [sys.executable, "-m", "hybridflow.data.tasks", "calculator", "--out", str(plain), "--train", "2000",
             "--test", "60"],
            check=True,
        )  # fmt: skip
    described = out / "data" / "calculator_tools_in_system"
    described.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        frame = pd.read_parquet(plain / f"{split}.parquet")
        frame["prompt"] = [
            [{**m, "content": f"{m['content']}\n\n{tools_text([CALCULATOR])}"} if m["role"] == "system" else m
             for m in prompt]
            for prompt in frame["prompt"]
        ]  # fmt: skip
        frame.to_parquet(described / f"{split}.parquet")
    return {"endpoint": plain, "in-process": described}


def train(side: str, data: Path, seed: int, steps: int, test_freq: int, batch: int, run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        overrides = [
            f"data.train_files=[{data / 'train.parquet'}]",
            f"data.val_files=[{data / 'test.parquet'}]",
            "data.max_prompt_length=512",
            f"data.train_batch_size={batch}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={test_freq}",
            f"trainer.seed={seed}",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}",
            "trainer.resume_mode=disable",
        ]
        command = [sys.executable, "-m", "hybridflow.trainer.commands.train", "--config", str(SIDES[side])]
        subprocess.run([*command, *overrides], check=True, cwd=ROOT)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def held_out(records: list[dict]) -> dict[int, float]:
    """Step -> val/score/mean (step 0: before training)."""
    out = {}
    for record in records:
        if "val/score/mean" in record:
            out[int(record.get("step", record.get("global_step", 0)))] = record["val/score/mean"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="prompts per step (x rollout.n = 8 samples each)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/agent_learning"))
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "agent_endpoint_learning.png")
    args = parser.parse_args()
    data = make_data(args.out)
    curves: dict[tuple[str, int], dict[int, float]] = {}
    for seed in args.seeds:
        for side in SIDES:
            run_dir = args.out / f"{side}_seed{seed}"
            records = train(side, data[side], seed, args.steps, args.test_freq, args.batch, run_dir)
            curves[(side, seed)] = held_out(records)
            print(f"{side} seed {seed}: {curves[(side, seed)]}", flush=True)
    steps = sorted({step for curve in curves.values() for step in curve})
    print("\n| run | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("| --- |" + " --- |" * len(steps))
    for (side, seed), curve in curves.items():
        print(f"| {side}, seed {seed} | " + " | ".join(f"{curve.get(s, float('nan')):.2f}" for s in steps) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for (side, seed), curve in curves.items():
        style = "-" if side == "endpoint" else "--"
        axes.plot(list(curve), list(curve.values()), style, marker="o", label=f"{side}, seed {seed}")
    axes.set_xlabel("training step")
    axes.set_ylabel("held-out accuracy (greedy)")
    axes.set_title("calculator: endpoint vs in-process loop")
    axes.legend(fontsize=8)
    figure.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
