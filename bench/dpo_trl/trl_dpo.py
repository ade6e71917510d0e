"""TRL's side of bench/dpo_trl.py: DPO steps with `trl.DPOTrainer`, each timed, with the tokens it ran on.

Runs inside the bench's TRL environment (bench/.trl-venv, shared with bench/sft_trl.py), never in hybridflow's:

    bench/.trl-venv/bin/python bench/dpo_trl/trl_dpo.py --model DIR --data pairs.jsonl --steps 6 \
        --batch 8 --micro-batch 2 --beta 0.1 --precision fp32 --out result.json

The rows are the bench's pairs in TRL's conversational preference format: a prompt (chat messages) and a chosen
and a rejected answer (each one assistant message). One optimizer step per ``--batch`` pairs, in micro-batches of
``--micro-batch`` pairs (gradient accumulation; a micro-batch is one forward of its chosen rows stacked on its
rejected rows, right-padded to the longest of them), taken in the file's order (a sequential sampler), the sigmoid
(DPO) loss at ``--beta``, AdamW at a constant learning rate, grad-norm clip 1, no gradient checkpointing (TRL's
default turns it on; hybridflow's is off). The reference is a second copy of the model (with ``ref_model=None``
TRL 1.16 loads it again from the model's directory) and runs on every micro-batch inside the step, as hybridflow's
does (``precompute_ref_log_probs`` off). A ``TrainerCallback`` takes each optimizer step's time; ``compute_loss``
(once per micro-batch, the model's and the reference's forwards both inside it) is wrapped to count the real
(non-pad) tokens each step ran on, chosen and rejected, prompt included, each counted once, and the padded ones.
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
from trl import DPOConfig, DPOTrainer  # noqa: E402


class StepTimer(TrainerCallback):
    """Seconds of each optimizer step: from its first micro-batch's forward to after the optimizer's update (the
    Trainer collates a step's micro-batches before ``on_step_begin``)."""

    def __init__(self):
        self.started = 0.0
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.started)


def add_to_step(counts: list[int], step: int, count: int) -> None:
    while len(counts) <= step:
        counts.append(0)
    counts[step] += count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="jsonl rows: prompt, chosen and rejected message lists")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=2, help="pairs per forward/backward")
    parser.add_argument("--max-length", type=int, default=1024, help="longest prompt+answer (as hybridflow's)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.batch % args.micro_batch:
        parser.error(f"--batch {args.batch} is not a multiple of --micro-batch {args.micro_batch}")
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    if len(rows) < args.batch * args.steps:
        parser.error(f"{args.data} has {len(rows)} pairs; {args.steps} steps of {args.batch} need more")
    dataset = Dataset.from_list(rows)
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-dpo-"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.batch // args.micro_batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.01,  # hybridflow's optim.weight_decay
        max_grad_norm=1.0,
        beta=args.beta,
        loss_type=["sigmoid"],
        max_length=args.max_length,
        precompute_ref_log_probs=False,
        gradient_checkpointing=False,  # TRL's default is on; hybridflow's model.enable_gradient_checkpointing is off
        train_sampling_strategy="sequential",  # the file's order, as hybridflow's data.shuffle=false
        bf16=args.precision == "bf16",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=0,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    timer = StepTimer()
    trainer = DPOTrainer(
        model=model, ref_model=None, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer]
    )
    if trainer.ref_model is None or trainer.ref_model is trainer.model:
        raise SystemExit("TRL built no separate reference model; this bench times a reference forward each step")
    tokens: list[int] = []
    padded: list[int] = []
    compute_loss = trainer.compute_loss

    def counting_loss(model, inputs, *rest, **kwargs):
        # input_ids: the micro-batch's chosen rows, then its rejected rows, right-padded to the longest of them all
        add_to_step(tokens, trainer.state.global_step, int(inputs["attention_mask"].sum()))
        add_to_step(padded, trainer.state.global_step, int(inputs["input_ids"].numel()))
        return compute_loss(model, inputs, *rest, **kwargs)

    trainer.compute_loss = counting_loss
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "attention": model.config._attn_implementation,
        "reference": f"{type(trainer.ref_model).__name__}, loaded by TRL from {model.config._name_or_path}",
        "step_seconds": timer.seconds,
        "step_tokens": tokens[: len(timer.seconds)],
        "step_padded_tokens": padded[: len(timer.seconds)],
        "losses": losses,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
