"""TRL's side of bench/sft_trl.py: supervised steps with `trl.SFTTrainer`, each timed, with the tokens it ran on.

Runs inside the bench's TRL environment (bench/.trl-venv, shared with bench/grpo_step.py), never in hybridflow's:

    bench/.trl-venv/bin/python bench/sft_trl/trl_sft.py --model DIR --data rows.jsonl --steps 6 \
        --batch 16 --micro-batch 4 --max-length 512 --precision bf16 --out result.json

The rows are the bench's: a prompt and a completion, each a list of chat messages (TRL's conversational
prompt-completion format; the loss covers the completion). One optimizer step per ``--batch`` samples, in
micro-batches of ``--micro-batch`` (gradient accumulation), AdamW at a constant learning rate, grad-norm clip 1.
A ``TrainerCallback`` takes each optimizer step's time; ``compute_loss`` is wrapped to count the real (non-pad)
tokens each step ran on, so tokens per second compare with hybridflow's whatever the order of the samples.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402


class StepTimer(TrainerCallback):
    def __init__(self):
        self.started = 0.0
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="jsonl rows with prompt and completion message lists")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per forward/backward")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(rows)
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-sft-"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.batch // args.micro_batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_length=args.max_length,
        bf16=args.precision == "bf16",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=0,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    timer = StepTimer()
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
    tokens: list[int] = []
    losses: list[float] = []
    compute_loss = trainer.compute_loss

    def counting_loss(model, inputs, *rest, **kwargs):
        mask = inputs.get("attention_mask")
        count = int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        step = trainer.state.global_step
        while len(tokens) <= step:
            tokens.append(0)
        tokens[step] += count
        return compute_loss(model, inputs, *rest, **kwargs)

    trainer.compute_loss = counting_loss
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "step_seconds": timer.seconds,
        "step_tokens": tokens[: len(timer.seconds)],
        "losses": losses,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
