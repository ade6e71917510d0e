"""TRL's side of bench/grpo_step.py: GRPO steps with `trl.GRPOTrainer`, timed per stage.

Runs inside the bench's own TRL environment (bench/.trl-venv), never in hybridflow's; the
parent script starts it as

    bench/.trl-venv/bin/python bench/grpo_step/trl_grpo.py --model DIR --data train.parquet \
        --steps 4 --lr 1e-5 --precision bf16 --out result.json

The workload is hybridflow's: 8 prompts x 4 completions per optimizer step (one micro-batch of
32 by default), at most 32 new tokens, temperature 1 with no top-k/top-p, no KL (`beta=0`), no
vLLM, AdamW with hybridflow's defaults (weight decay 0.01, grad-norm clip 1, constant lr).
The reward is hybridflow's arithmetic scorer: `numbers.py` (stdlib only) is loaded from the
repository by file path, and the six lines of `extract_final_number` are copied below, so
nothing of hybridflow's dependencies enters this environment.

Timing: a `TrainerCallback` takes each optimizer step from `on_step_begin` to `on_step_end`;
the trainer's own methods are wrapped to split it. TRL logs its `profiling/...` times only to
wandb/mlflow/trackio, so they cannot be read back here.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def load_numbers_module():
    """hybridflow/reward/scorers/numbers.py by file path: find_numbers, same_number (stdlib only)."""
    path = REPO / "hybridflow" / "reward" / "scorers" / "numbers.py"
    spec = importlib.util.spec_from_file_location("hybridflow_numbers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


numbers = load_numbers_module()


def extract_final_number(solution_str: str) -> str | None:
    """Copied from hybridflow/reward/scorers/arithmetic.py: the number after the last "####", else the last number."""
    if "####" in solution_str:
        after = numbers.find_numbers(solution_str.rsplit("####", 1)[1])
        if after:
            return after[0]
    found = numbers.find_numbers(solution_str)
    return found[-1] if found else None


def arithmetic_reward(completions, ground_truth, **kwargs) -> list[float]:
    """TRL's reward signature: one float per completion (conversational: a list of messages)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(numbers.same_number(extract_final_number(t), gt)) for t, gt in zip(texts, ground_truth)]


def load_prompts(path: str) -> Dataset:
    """hybridflow's parquet (`prompt`: chat messages, `reward_model.ground_truth`) as TRL's conversational dataset."""
    frame = pd.read_parquet(path)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": m["role"], "content": m["content"]} for m in p] for p in frame["prompt"]],
            "ground_truth": [str(r["ground_truth"]) for r in frame["reward_model"]],
        }
    )


class StageTimer:
    """Seconds per optimizer step: the whole step and the wrapped trainer methods inside it."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, trainer: GRPOTrainer, method: str, stage: str) -> None:
        original = getattr(trainer, method)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[stage] += time.perf_counter() - start

        setattr(trainer, method, timed)  # instance attribute: self.<method>(...) inside TRL finds it first


class StepCallback(TrainerCallback):
    def __init__(self, timer: StageTimer):
        self.timer = timer
        self.start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.timer.current = defaultdict(float)
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        stages = dict(self.timer.current)
        stages["step"] = time.perf_counter() - self.start
        self.timer.steps.append(stages)


def split_stages(raw: dict[str, float]) -> dict[str, float]:
    """gen | reward | old_log_prob (0 when TRL skips it) | prep (tokenise, pad, advantages) | update (the rest)."""
    make = raw.get("make_experience", 0.0)
    inner = {stage: raw.get(stage, 0.0) for stage in ("gen", "reward", "old_log_prob")}
    return {
        **inner,
        "prep": make - sum(inner.values()),
        "update": raw["step"] - make,
        "step": raw["step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument(
        "--micro-batch", type=int, default=32, help="completions per forward/backward (32: no accumulation)"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--generation", choices=["generate", "continuous_batching"], default="generate",
        help="model.generate on a padded batch, or transformers' continuous batching "
        "(TRL casts the model to bf16 for it)",
    )  # fmt: skip
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    completions = args.prompts * args.n
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        use_cpu=True,
        bf16=args.precision == "bf16",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=completions // args.micro_batch,
        num_generations=args.n,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        use_vllm=False,
        use_transformers_continuous_batching=args.generation == "continuous_batching",
        activation_checkpointing=False,  # TRL's default is True (alias gradient_checkpointing); hybridflow's is off
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=arithmetic_reward, args=config, train_dataset=load_prompts(args.data)
    )
    timer = StageTimer()
    timer.wrap(trainer, "_generate_and_score_completions", "make_experience")
    timer.wrap(trainer, "_generate", "gen")
    timer.wrap(trainer, "_calculate_rewards", "reward")
    original_logps = trainer._get_per_token_logps_and_entropies

    def logps(model, *a, **kw):  # under no_grad it is the old-log-prob pass; with grad it is the loss's forward
        if torch.is_grad_enabled():
            return original_logps(model, *a, **kw)
        start = time.perf_counter()
        try:
            return original_logps(model, *a, **kw)
        finally:
            timer.current["old_log_prob"] += time.perf_counter() - start

    trainer._get_per_token_logps_and_entropies = logps
    trainer.add_callback(StepCallback(timer))
    trainer.train()

    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    result = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "precision": args.precision,
        "generation": args.generation,
        "micro_batch": args.micro_batch,
        "threads": torch.get_num_threads(),
        "model_dtype": str(next(trainer.model.parameters()).dtype),
        "steps": [split_stages(raw) for raw in timer.steps],
        "response_length": [entry["completions/mean_length"] for entry in logs],
        "reward": [entry.get("reward", float("nan")) for entry in logs],
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
