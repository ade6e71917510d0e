"""Supervised fine-tuning: hybridflow's `hybridflow sft` against TRL's `SFTTrainer`, tokens per second on the same
data and model (run by hand, not a test).

    .venv/bin/python bench/sft_trl.py                      # every setting: ~20 min on 2 cores
    .venv/bin/python bench/sft_trl.py --steps 4 --layouts 1x2 --trl-settings bf16+alloc   # quicker

The workload: `smollm2-135m-instruct`, the calculator task's gold trajectories (`python -m hybridflow.data.tasks
calculator --gold`: a system prompt with a worked example, the question, the tool call, the tool's message, the
answer; ~210 tokens a sample), 16 samples per optimizer step in micro-batches of 4 per rank, AdamW at lr 1e-5,
grad-norm clip 1. Each side runs `--steps` steps; the first is warm-up, the rest are counted: tokens per second
is the real (non-padding) tokens of the counted steps over their seconds. hybridflow runs `hybridflow sft` (its
defaults: packed, bf16 compute where the CPU has it) on W Ray workers of T threads (`--layouts WxT`); TRL runs
in bench/.trl-venv (bench/sft_trl/trl_sft.py), one process of 2 threads, in bf16 autocast or fp32, with glibc's
default allocator settings or (`+alloc`) those of hybridflow's workers (freed memory kept for reuse), its rows
in TRL's prompt-completion format (the loss on the completion: the call, the tool's message and the answer;
the loss mask does not change the work, every token runs forward and backward on both sides). TRL pads each
micro-batch to its longest row (its padding-free mode needs flash attention, which the CPU has not).

The machine is shared: each run waits (up to `--wait` s) for the 1-minute load to fall below `--max-load`, and
the loads at its start and end are printed. Results go to --out/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import ensure_trl_venv, fastest_ratio, tokens_per_second, wait_for_idle  # noqa: E402

from hybridflow.data.io import read_rows, write_rows  # noqa: E402
from hybridflow.data.tasks import write_task  # noqa: E402
from hybridflow.models import resolve_model_path  # noqa: E402

MODEL = "smollm2-135m-instruct"
TRL_SCRIPT = REPO / "bench" / "sft_trl" / "trl_sft.py"


def make_data(out: Path, samples: int) -> tuple[Path, Path]:
    """The gold trajectories for hybridflow (a messages column) and the same rows for TRL (prompt, completion)."""
    gold = write_task("calculator", out / "gold", train=samples, test=1, seed=0, gold=True)["train"]
    trl_rows = []
    for row in read_rows(gold):
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        trl_rows.append({"prompt": messages[:-3], "completion": messages[-3:]})  # the call, the tool, the answer
    return gold, write_rows(trl_rows, out / "trl_rows.jsonl")


def run_hybridflow(args, data: Path, layout: str) -> dict:
    workers, threads = (int(x) for x in layout.split("x"))
    run_dir = args.out / f"hybridflow-{layout}"
    overrides = [
        f"data.train_files=[{data}]",
        f"model.path={MODEL}",
        f"data.train_batch_size={args.batch}",
        "data.shuffle=false",
        f"engine.micro_batch_size_per_gpu={args.micro_batch}",
        f"optim.lr={args.lr}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.n_workers_per_node={workers}",
        f"trainer.cpus_per_worker={threads}",
        f"trainer.threads_per_worker={threads}",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]
    load = wait_for_idle(args.max_load, args.wait)
    print(f"hybridflow sft {layout}: {args.steps} steps (load {load:.2f}) ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "hybridflow.trainer.commands.sft", *overrides], cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"hybridflow's run failed (exit {done.returncode})")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((s for s in steps if "timing_s/step" in s), key=lambda s: s["step"])
    return {
        "system": "hybridflow",
        "setting": f"{workers} workers x {threads} threads, packed, engine.fsdp.param_dtype=auto",
        "tokens_per_second": tokens_per_second([s["train/tokens"] for s in steps], [s["timing_s/step"] for s in steps]),
        "step_s": statistics.median(s["timing_s/step"] for s in steps[1:]),
        "losses": [s["sft/loss"] for s in steps],
        "load": load,
        "load_end": os.getloadavg()[0],
    }


def run_trl(args, python: Path, data: Path, setting: str) -> dict:
    """One TRL run; ``setting`` is a precision (bf16 | fp32), with ``+alloc`` for hybridflow's allocator settings."""
    from hybridflow.controller.ray_runtime import ALLOCATOR_ENV

    precision, _, option = setting.partition("+")
    out = args.out / f"trl-{setting}.json"
    cmd = [
        str(python), str(TRL_SCRIPT), "--model", str(resolve_model_path(MODEL)), "--data", str(data),
        "--steps", str(args.steps), "--batch", str(args.batch), "--micro-batch", str(args.micro_batch),
        "--lr", str(args.lr), "--precision", precision, "--threads", "2", "--out", str(out),
    ]  # fmt: skip
    load = wait_for_idle(args.max_load, args.wait)
    print(f"TRL SFTTrainer {setting}: {args.steps} steps (load {load:.2f}) ...", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if option == "alloc":
        env.update(ALLOCATOR_ENV)
    log = args.out / f"trl-{setting}.log"
    with log.open("w") as handle:
        done = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"TRL's run failed (exit {done.returncode}); its log: {log}\n" + log.read_text()[-3000:])
    result = json.loads(out.read_text())
    return {
        "system": "TRL",
        "setting": f"1 process x {result['threads']} threads, {precision}"
        + (", allocator keeps freed memory (as hybridflow's workers)" if option == "alloc" else "")
        + f", TRL {result['versions']['trl']}",
        "tokens_per_second": tokens_per_second(result["step_tokens"], result["step_seconds"]),
        "step_s": statistics.median(result["step_seconds"][1:]),
        "losses": result["losses"],
        "load": load,
        "load_end": os.getloadavg()[0],
    }


def report(results: list[dict]) -> str:
    lines = ["| system | setting | tokens/s | step s (median) | load start/end |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(
            f"| {r['system']} | {r['setting']} | {r['tokens_per_second']:.0f} | {r['step_s']:.2f} | "
            f"{r['load']:.2f} / {r['load_end']:.2f} |"
        )
    return "\n".join(lines) + fastest_ratio(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first is warm-up, not counted")
    parser.add_argument("--batch", type=int, default=16, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per forward/backward (per rank)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--layouts", nargs="+", default=["2x1", "1x2"], help="hybridflow's WORKERSxTHREADS")
    parser.add_argument(
        "--trl-settings",
        nargs="+",
        default=["bf16+alloc", "bf16", "fp32"],
        choices=["bf16+alloc", "bf16", "fp32"],
        help="precision, +alloc: glibc's allocator keeps freed memory, as in hybridflow's workers",
    )
    parser.add_argument("--max-load", type=float, default=0.5)
    parser.add_argument("--wait", type=float, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sft_trl")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gold, trl_rows = make_data(args.out / "data", args.batch * args.steps)
    results = [run_hybridflow(args, gold, layout) for layout in args.layouts]
    python = ensure_trl_venv()
    results += [run_trl(args, python, trl_rows, setting) for setting in args.trl_settings]
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(report(results))


if __name__ == "__main__":
    main()
