"""The training service's overhead: one forward_backward + optim_step of a cookbook-sized batch through
`hybridflow serve` (the tinker SDK over HTTP), against the same step through hybridflow's own SFT trainer, in the
same run (by hand, not a test).

    .venv/bin/python bench/serve.py                 # ~10 min on 2 cores
    .venv/bin/python bench/serve.py --steps 3       # quicker

The workload: `smollm2-135m-instruct` with LoRA rank 32 on every attention and MLP layer, fp32, 128 conversations
per step (tinker-cookbook's sl_loop batch) of the arithmetic task (a question and its answer, ~30 tokens each),
AdamW at lr 1e-4 with betas (0.9, 0.95), grad-norm clip 1. The trainer runs `hybridflow sft` on one Ray worker of
2 threads (packed); the service runs on one worker of 2 threads, the SDK sending each step's 128 datums (the same
token sequences, weighted so that the loss is the trainer's token mean) and the optimizer step, and waiting for
both. Each side runs `--steps` steps; the first is warm-up. Printed: the median step of each, their ratio, and how
much of the service's step the worker's calls take (the rest is the SDK, HTTP, protobuf and the queue). The first
step's loss must equal the trainer's (the adapters start with B = 0, so both compute the base model).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import wait_for_idle  # noqa: E402

from hybridflow.data.io import write_rows  # noqa: E402
from hybridflow.data.sft_dataset import SFTDataset  # noqa: E402
from hybridflow.data.tasks.arithmetic import make_rows  # noqa: E402
from hybridflow.data.token_rows import token_mean_batch  # noqa: E402
from hybridflow.models import load_tokenizer, resolve_model_path  # noqa: E402
from hybridflow.trainer.setup.sft_config import load_sft_config  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY = "tml-bench-serve-key-0000"
LR, BETAS, EPS, CLIP = 1e-4, (0.9, 0.95), 1e-8, 1.0


def make_data(out: Path, rows: int) -> Path:
    conversations = []
    for row in make_rows(rows, split="train", seed=0):
        answer = row["reward_model"]["ground_truth"]
        conversations.append({"messages": [*row["prompt"], {"role": "assistant", "content": answer}]})
    return write_rows(conversations, out / "conversations.jsonl")


def run_trainer(args, data: Path) -> dict:
    run_dir = args.out / "trainer"
    overrides = [
        f"data.train_files=[{data}]",
        f"model.path={MODEL}",
        "model.lora.rank=32",
        "model.lora.alpha=32",
        f"data.train_batch_size={args.batch}",
        "data.shuffle=false",
        "engine.micro_batch_size_per_gpu=32",
        "engine.fsdp.param_dtype=fp32",
        f"engine.grad_clip={CLIP}",
        f"optim.lr={LR}",
        f"optim.betas=[{BETAS[0]},{BETAS[1]}]",
        f"optim.eps={EPS}",
        "optim.weight_decay=0.0",
        f"trainer.total_training_steps={args.steps}",
        "trainer.n_workers_per_node=1",
        "trainer.cpus_per_worker=2",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]
    load = wait_for_idle(args.max_load, args.wait)
    print(f"hybridflow sft: {args.steps} steps (load {load:.2f}) ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "hybridflow.trainer.commands.sft", *overrides], cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"the trainer's run failed (exit {done.returncode})")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((s for s in steps if "timing_s/step" in s), key=lambda s: s["step"])
    return {
        "step_s": statistics.median(s["timing_s/step"] for s in steps[1:]),
        "losses": [s["sft/loss"] for s in steps],
        "load": load,
        "load_end": os.getloadavg()[0],
    }


def batches(data: Path, batch: int, steps: int):
    """The trainer's first ``steps`` batches (unshuffled) as datums weighted to the batch's token mean."""
    from tinker import types

    config = load_sft_config([f"data.train_files=[{data}]", f"model.path={MODEL}"]).data
    dataset = SFTDataset([str(data)], load_tokenizer(resolve_model_path(MODEL)), config)
    for step in range(steps):
        rows = [dataset[i] for i in range(step * batch, (step + 1) * batch)]
        datums = [
            types.Datum(
                model_input=types.ModelInput.from_ints(inputs),
                loss_fn_inputs={"target_tokens": np.asarray(targets, dtype=np.int64), "weights": weights},
            )
            for inputs, targets, weights in token_mean_batch(rows)
        ]
        yield datums


@contextlib.contextmanager
def service(args):
    port = 8000 + os.getpid() % 1000
    env = {**os.environ, "HYBRIDFLOW_SERVE_API_KEYS": KEY, "TINKER_TELEMETRY": "0"}
    command = [
        sys.executable, "-m", "hybridflow.serve.main", f"model.path={MODEL}", f"service.port={port}",
        f"service.storage_dir={args.out / 'storage'}", "worker.cpus_per_worker=2",
        f"limits.max_datums_per_request={args.batch}",
    ]  # fmt: skip
    log = (args.out / "service.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            if process.poll() is not None:
                raise SystemExit(f"the service exited; its log: {args.out / 'service.log'}")
            time.sleep(1)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
        log.close()


def run_service(args, data: Path) -> dict:
    import tinker
    from tinker import types

    load = wait_for_idle(args.max_load, args.wait)
    print(f"hybridflow serve: {args.steps} steps (load {load:.2f}) ...", flush=True)
    with service(args) as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        # the trainer's adapters: attention and MLP layers (its all-linear), not the output head
        model = client.create_lora_training_client(base_model=MODEL, rank=32, seed=0, train_unembed=False).result()
        adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, grad_clip_norm=CLIP)
        seconds, worker, losses = [], [], []
        for datums in batches(data, args.batch, args.steps):
            start = time.perf_counter()
            step = model.forward_backward(datums, "cross_entropy")
            optim = model.optim_step(adam)
            result, optimized = step.result(), optim.result()
            seconds.append(time.perf_counter() - start)
            worker.append(result.metrics["worker_seconds:sum"] + optimized.metrics["worker_seconds:sum"])
            losses.append(result.metrics["loss:sum"])
        client.close("success").result(timeout=60)
    return {
        "step_s": statistics.median(seconds[1:]),
        "worker_s": statistics.median(worker[1:]),
        "losses": losses,
        "load": load,
        "load_end": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="steps per side; the first is warm-up, not counted")
    parser.add_argument("--batch", type=int, default=128, help="conversations per step (tinker-cookbook sl_loop's)")
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--wait", type=float, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "serve")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = make_data(args.out, args.batch * args.steps)
    trainer = run_trainer(args, data)
    served = run_service(args, data)
    ratio = served["step_s"] / trainer["step_s"]
    overhead = served["step_s"] - served["worker_s"]
    print(
        "| path | step s (median) | worker s | load start/end |\n| --- | --- | --- | --- |\n"
        f"| hybridflow sft | {trainer['step_s']:.2f} | | {trainer['load']:.2f} / {trainer['load_end']:.2f} |\n"
        f"| hybridflow serve (SDK) | {served['step_s']:.2f} | {served['worker_s']:.2f} | "
        f"{served['load']:.2f} / {served['load_end']:.2f} |\n"
        f"service / trainer: {ratio:.2f}x; outside the worker (SDK, HTTP, protobuf, queue): {overhead:.2f} s a step "
        f"({overhead / served['step_s']:.0%})\n"
        f"first-step loss: trainer {trainer['losses'][0]:.6f}, service {served['losses'][0]:.6f}"
    )
    (args.out / "results.json").write_text(json.dumps({"trainer": trainer, "service": served}, indent=1))


if __name__ == "__main__":
    main()
