"""Direct preference optimisation: hybridflow's `hybridflow dpo` against TRL's `DPOTrainer`, tokens per second on the
same preference pairs and model (run by hand, not a test).

    .venv/bin/python bench/dpo_trl.py                      # every setting, on data/arithmetic_pairs/train.parquet
    .venv/bin/python bench/dpo_trl.py --steps 4 --trl-settings fp32 --pairs pairs.parquet   # quicker

The workload: `smollm2-135m-instruct` as both the trained model and the frozen reference, the first
`--batch` x `--steps` pairs of `--pairs` in the file's order (no shuffle on either side; rows with a "prompt" of
chat messages and a "chosen" and a "rejected" answer text, e.g. the arithmetic pairs), `--batch` pairs per
optimizer step in micro-batches of `--micro-batch` pairs per rank (2 x that many rows: the chosen and the rejected
answer of each pair), the sigmoid (DPO) loss at beta `--beta`, AdamW at lr `--lr` (constant, weight decay 0.01),
grad-norm clip 1, no gradient checkpointing (TRL's default turns it on: set off here, as hybridflow's). Each step
runs the reference's forward on its pairs and the model's forward and backward, on both sides (TRL's
`precompute_ref_log_probs` is off). Each side runs `--steps` steps; the first is warm-up, the rest are counted:
tokens per second is the real (non-padding) tokens of the counted steps over their seconds, a token being one of a
pair's two templated prompt+answer sequences (prompt included, both answers, counted once though the reference and
the model both run on it). TRL's chat-templated rows keep the newline after <|im_end|>, one token more per answer
than hybridflow's (the tokens/pair column; tokens per second is per token, whichever side has more).

hybridflow runs `hybridflow dpo` (its defaults: packed, compute dtype engine.fsdp.param_dtype=auto: bf16 where the
CPU has bf16 matmul units, else fp32) on W Ray workers of T threads (`--layouts WxT`); TRL runs in bench/.trl-venv
(bench/dpo_trl/trl_dpo.py), one process of 2 threads, in fp32 or bf16 autocast (a CPU without AVX512-BF16 or AMX
converts bf16 in software: slower there, and its rounding shows in the loss from the second step), optionally
(`+alloc`) with the glibc allocator settings of hybridflow's workers (freed memory kept for reuse), its rows in
TRL's conversational preference format. TRL pads each micro-batch, chosen and rejected rows together, to its longest
row (its padding-free mode is switched off in TRL 1.16, and needs flash attention, which the CPU has not), and on a
CPU its fused LM head scores every position, padding included (the padding column: the padded share of its rows).

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
from hybridflow.models import resolve_model_path  # noqa: E402
from hybridflow.models.dtypes import parse_dtype  # noqa: E402

MODEL = "smollm2-135m-instruct"
PAIRS = REPO / "data" / "arithmetic_pairs" / "train.parquet"  # examples/dpo_arithmetic_smollm2.yaml makes it
TRL_SCRIPT = REPO / "bench" / "dpo_trl" / "trl_dpo.py"


def make_data(pairs: Path, out: Path, count: int) -> tuple[Path, Path]:
    """The first ``count`` pairs of ``pairs``, in order: for hybridflow (prompt, chosen and rejected text, margin)
    and for TRL (its conversational preference format: the answers as one assistant message each)."""
    if not pairs.is_file():
        raise SystemExit(f"{pairs} does not exist: make it (examples/dpo_arithmetic_smollm2.yaml), or give --pairs")
    rows = read_rows(pairs)
    if len(rows) < count:
        raise SystemExit(f"{pairs} has {len(rows)} pairs; --steps x --batch need {count}")
    ours, theirs = [], []
    for row in rows[:count]:
        prompt = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
        ours.append(
            {"prompt": prompt, "chosen": row["chosen"], "rejected": row["rejected"], "margin": row.get("margin", 0.0)}
        )
        theirs.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": row["chosen"]}],
                "rejected": [{"role": "assistant", "content": row["rejected"]}],
            }
        )
    return write_rows(ours, out / "pairs.jsonl"), write_rows(theirs, out / "trl_pairs.jsonl")


def run_hybridflow(args, data: Path, layout: str) -> dict:
    workers, threads = (int(x) for x in layout.split("x"))
    run_dir = args.out / f"hybridflow-{layout}"
    overrides = [
        f"data.train_files=[{data}]",
        f"model.path={MODEL}",
        f"data.train_batch_size={args.batch}",
        "data.shuffle=false",
        f"engine.micro_batch_size_per_gpu={2 * args.micro_batch}",  # rows: the chosen and the rejected answer
        f"optim.lr={args.lr}",
        f"algorithm.beta={args.beta}",
        "algorithm.loss_type=sigmoid",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.n_workers_per_node={workers}",
        f"trainer.cpus_per_worker={threads}",
        f"trainer.threads_per_worker={threads}",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_dir}",
    ]
    load = wait_for_idle(args.max_load, args.wait)
    print(f"hybridflow dpo {layout}: {args.steps} steps (load {load:.2f}) ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "hybridflow.trainer.commands.dpo", *overrides], cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"hybridflow's run failed (exit {done.returncode})")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((s for s in steps if "timing_s/step" in s), key=lambda s: s["step"])
    tokens = [s["train/tokens"] for s in steps]
    dtype = str(parse_dtype("auto")).removeprefix("torch.")
    return {
        "system": "hybridflow",
        "setting": f"{workers} workers x {threads} threads, packed, engine.fsdp.param_dtype=auto ({dtype})",
        "tokens_per_second": tokens_per_second(tokens, [s["timing_s/step"] for s in steps]),
        "step_s": statistics.median(s["timing_s/step"] for s in steps[1:]),
        "step_tokens": tokens,
        "tokens_per_pair": sum(tokens) / (len(tokens) * args.batch),
        "padded_share": 0.0,
        "losses": [s["dpo/loss"] for s in steps],
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
        "--lr", str(args.lr), "--beta", str(args.beta), "--precision", precision, "--threads", "2",
        "--out", str(out),
    ]  # fmt: skip
    load = wait_for_idle(args.max_load, args.wait)
    print(f"TRL DPOTrainer {setting}: {args.steps} steps (load {load:.2f}) ...", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if option == "alloc":
        env.update(ALLOCATOR_ENV)
    log = args.out / f"trl-{setting}.log"
    with log.open("w") as handle:
        done = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"TRL's run failed (exit {done.returncode}); its log: {log}\n" + log.read_text()[-3000:])
    result = json.loads(out.read_text())
    tokens = result["step_tokens"]
    return {
        "system": "TRL",
        "setting": f"1 process x {result['threads']} threads, {precision}"
        + (", allocator keeps freed memory (as hybridflow's workers)" if option == "alloc" else "")
        + f", TRL {result['versions']['trl']}",
        "tokens_per_second": tokens_per_second(tokens, result["step_seconds"]),
        "step_s": statistics.median(result["step_seconds"][1:]),
        "step_tokens": tokens,
        "tokens_per_pair": sum(tokens) / (len(tokens) * args.batch),
        "padded_share": 1 - sum(tokens) / sum(result["step_padded_tokens"]),
        "losses": result["losses"],
        "load": load,
        "load_end": os.getloadavg()[0],
    }


def report(results: list[dict]) -> str:
    lines = [
        "| system | setting | tokens/s | step s (median) | tokens/pair | padding | load start/end |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['system']} | {r['setting']} | {r['tokens_per_second']:.0f} | {r['step_s']:.2f} | "
            f"{r['tokens_per_pair']:.1f} | {r['padded_share']:.0%} | {r['load']:.2f} / {r['load_end']:.2f} |"
        )
    return "\n".join(lines) + fastest_ratio(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=Path, default=PAIRS, help="parquet/jsonl: prompt, chosen, rejected, margin")
    parser.add_argument("--steps", type=int, default=8, help="steps per run; the first is warm-up, not counted")
    parser.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=2,
        help="pairs per forward/backward per rank (hybridflow: 2x as many rows; TRL: per_device_train_batch_size)",
    )
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--layouts", nargs="+", default=["2x1"], help="hybridflow's WORKERSxTHREADS")
    parser.add_argument(
        "--trl-settings",
        nargs="+",
        default=["fp32", "bf16"],
        choices=["fp32", "bf16", "fp32+alloc", "bf16+alloc"],
        help="precision, +alloc: glibc's allocator keeps freed memory, as in hybridflow's workers",
    )
    parser.add_argument("--max-load", type=float, default=0.5)
    parser.add_argument("--wait", type=float, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dpo_trl")
    args = parser.parse_args()
    if args.batch % args.micro_batch:
        parser.error(f"--batch {args.batch} is not a multiple of --micro-batch {args.micro_batch}")
    args.out.mkdir(parents=True, exist_ok=True)
    ours, theirs = make_data(args.pairs, args.out / "data", args.batch * args.steps)
    results = [run_hybridflow(args, ours, layout) for layout in args.layouts]
    python = ensure_trl_venv()
    results += [run_trl(args, python, theirs, setting) for setting in args.trl_settings]
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(report(results))


if __name__ == "__main__":
    main()
