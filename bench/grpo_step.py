"""One GRPO step: hybridflow against TRL's `GRPOTrainer` on the same workload (run by hand, not a test).

    .venv/bin/python bench/grpo_step.py                  # every setting: ~25 min of runs and waits on 2 cores
    .venv/bin/python bench/grpo_step.py --write-doc      # ... and rewrite docs/log/grpo_step.md
    .venv/bin/python bench/grpo_step.py --rollout native --layouts 1x2 --trl-precision bf16 --steps 3  # quicker
    # any hybridflow key:
    .venv/bin/python bench/grpo_step.py --override actor_rollout_ref.actor.use_remove_padding=false

The workload: `smollm2-135m-instruct` (hybridflow's built-in, materialised as a plain Hugging
Face directory that TRL loads too), the built-in arithmetic task, 8 prompts x 4 samples per
step, at most 32 new tokens, temperature 1, lr 1e-5 constant, no KL, one optimizer step per
batch. Each side runs `--steps` steps; the first is discarded as warm-up (first calls, lazy
allocations) and the table shows the mean over the others.

hybridflow runs in this process through `hybridflow.trainer.commands.train.run(load_config([...]))`, once
per rollout backend and worker layout (`WxT`: W Ray workers of T torch threads each); its
per-stage seconds come from the run's metrics.jsonl. TRL runs in its own virtual environment,
bench/.trl-venv, created on first use (`torch==2.13.0` first, then `trl==1.16.0` with torch held
at 2.13.0; reused afterwards), through bench/grpo_step/trl_grpo.py, once per precision.
Each side's fastest setting is compared; every setting measured is listed.

The machine is shared: before each run the script waits (up to `--wait` seconds) for the
1-minute load average to fall below `--max-load`; a run that ends with the load above
`--max-end-load` (a run alone brings it to about 2) was disturbed and is repeated, up to
`--retries` times. The loads at the start and end of each run are printed and written down.
Results also go to WORK/results.json. Add bench/.trl-venv to .gitignore.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import ensure_trl_venv, wait_for_idle  # noqa: E402
from grpo_step.report import Measurement, hybridflow_stages, load_results, print_report, save_results, write_doc  # noqa: E402

TRL_SCRIPT = REPO / "bench" / "grpo_step" / "trl_grpo.py"
MODEL = "smollm2-135m-instruct"


def measure(args, run_once):
    """run_once() -> Measurement | None, repeated (up to --retries times) while the load shows that something
    else ran."""
    for _ in range(args.retries + 1):
        result = run_once()
        if result is None:
            return None
        print(
            f"  {result.mean('step'):.2f} s per step; load {result.load:.2f} at the start, "
            f"{result.load_end:.2f} at the end",
            flush=True,
        )
        if result.load_end <= args.max_end_load:
            break
        print(f"  the load rose above {args.max_end_load}: something else ran during the run", flush=True)
    return result


def make_data(work: Path) -> Path:
    out = work / "arithmetic"
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.data.tasks",
        "arithmetic",
        "--out",
        str(out),
        "--train",
        "64",
        "--test",
        "8",
        "--seed",
        "0",
    ]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out / "train.parquet"


# ---- hybridflow ------------------------------------------------------------------------------


def hybridflow_overrides(args, train_file: Path, run_dir: Path, rollout: str, workers: int, threads: int) -> list[str]:
    samples_per_rank = args.prompts * args.n // workers
    return [
        f"data.train_files=[{train_file}]",
        f"actor_rollout_ref.model.path={MODEL}",
        "algorithm.adv_estimator=grpo",
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.response_length={args.new_tokens}",
        f"actor_rollout_ref.rollout.name={rollout}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch or samples_per_rank}",
        f"actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu={args.micro_batch or samples_per_rank}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "algorithm.use_kl_in_reward=false",
        f"trainer.n_workers_per_node={workers}",
        f"trainer.cpus_per_worker={threads}",
        f"trainer.threads_per_worker={threads}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
        *args.override,
    ]


def run_hybridflow(args, train_file: Path, work: Path, rollout: str, layout: str) -> Measurement | None:
    from hybridflow.trainer.commands.train import run
    from hybridflow.trainer.setup.check_config import check_config
    from hybridflow.trainer.setup.config import ConfigError, load_config

    workers, threads = (int(x) for x in layout.split("x"))
    name = f"hybridflow rollout={rollout} {workers} worker(s) x {threads} thread(s)"
    run_dir = work / f"hybridflow-{rollout}-{layout}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a repeated run starts afresh
    try:
        config = load_config(hybridflow_overrides(args, train_file, run_dir, rollout, workers, threads))
        check_config(config)
    except ConfigError as error:
        print(f"skipped {name}: the config does not accept it ({error})", flush=True)
        return None
    load = wait_for_idle(args.max_load, args.wait)
    print(f"{name}: {args.steps} steps (load {load:.2f}) ...", flush=True)
    run(config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return Measurement(
        system="hybridflow",
        setting=f"rollout={rollout}, {workers} worker(s) x {threads} thread(s)",
        steps=[hybridflow_stages(row) for row in rows],
        response_length=[row["response_length/mean"] for row in rows],
        load=load,
        load_end=os.getloadavg()[0],
    )


# ---- TRL -------------------------------------------------------------------------------------


TRL_OPTIONS = {
    "alloc": "allocator keeps freed memory (as hybridflow's workers)",
    "cb": "transformers' continuous batching for generation",
}


def run_trl(args, python: Path, model_dir: Path, train_file: Path, work: Path, setting: str) -> Measurement:
    """One TRL run; ``setting`` is a precision (bf16 | fp32) with optional +alloc and +cb (see TRL_OPTIONS)."""
    from hybridflow.controller.ray_runtime import ALLOCATOR_ENV

    precision, *options = setting.split("+")
    unknown = set(options) - set(TRL_OPTIONS)
    if precision not in ("bf16", "fp32") or unknown:
        raise SystemExit(
            f"unknown TRL setting {setting!r}: a precision (bf16, fp32) with optional +{' +'.join(TRL_OPTIONS)}"
        )
    out = work / f"trl-{setting}.json"
    cmd = [
        str(python), str(TRL_SCRIPT), "--model", str(model_dir), "--data", str(train_file), "--steps", str(args.steps),
        "--lr", str(args.lr), "--precision", precision, "--prompts", str(args.prompts), "--n", str(args.n),
        "--new-tokens", str(args.new_tokens), "--threads", "2", "--out", str(out),
        "--generation", "continuous_batching" if "cb" in options else "generate",
    ]  # fmt: skip
    load = wait_for_idle(args.max_load, args.wait)
    print(f"TRL GRPOTrainer {setting}: {args.steps} steps (load {load:.2f}) ...", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if "alloc" in options:
        env.update(ALLOCATOR_ENV)
    log = work / f"trl-{setting}.log"
    with log.open("w") as handle:
        done = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"TRL run failed (exit {done.returncode}); its log: {log}\n" + log.read_text()[-3000:])
    result = json.loads(out.read_text())
    described = [f"{precision} ({'autocast, fp32 master weights' if precision == 'bf16' else 'fp32'})"]
    described += [TRL_OPTIONS[o] for o in options]
    return Measurement(
        system="TRL",
        setting=", ".join(described) + f", 1 process x {result['threads']} threads",
        steps=result["steps"],
        response_length=result["response_length"],
        load=load,
        load_end=os.getloadavg()[0],
        versions=result["versions"],
    )


# ---- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up and not counted")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate of both (constant, AdamW)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="max new tokens per sample")
    parser.add_argument(
        "--rollout",
        default="hf,native",
        help="hybridflow rollout backends to try (comma list); one the config rejects is skipped",
    )
    parser.add_argument(
        "--layouts", default="1x2,2x1", help="hybridflow worker layouts WxT (W workers x T threads), comma list"
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="hybridflow samples per forward/backward (0: the whole per-rank batch)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra hybridflow config override (repeatable)",
    )
    parser.add_argument(
        "--trl-precision",
        default="bf16,bf16+alloc,bf16+alloc+cb,fp32",
        help="TRL settings to measure (comma list): a precision (bf16, fp32), optionally +alloc "
        "(the allocator settings "
        "of hybridflow's workers) and +cb (transformers' continuous batching for generation)",
    )
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-hybridflow", action="store_true")
    parser.add_argument(
        "--max-load", type=float, default=0.5, help="wait for the 1-minute load average to fall below this"
    )
    parser.add_argument(
        "--max-end-load", type=float, default=2.7, help="a run that ends above this load (its own is ~2) is repeated"
    )
    parser.add_argument("--retries", type=int, default=2, help="repeats of a run disturbed by other work")
    parser.add_argument("--wait", type=float, default=1800, help="seconds to wait for it before measuring anyway")
    parser.add_argument("--work", default="", help="directory for data, runs and logs (default: a new temporary one)")
    parser.add_argument("--write-doc", action="store_true", help="rewrite docs/log/grpo_step.md with this run's tables")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: report (and --write-doc) WORK/results.json of an earlier run",
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is warm-up)")
    return args


def report_only(args) -> None:
    if not args.work:
        raise SystemExit("--report-only needs --work, the directory of the run to report")
    measured = load_results(Path(args.work) / "results.json")
    print_report(measured)
    if args.write_doc:
        started = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime((Path(args.work) / "arithmetic").stat().st_mtime))
        command = "python bench/grpo_step.py " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "--report-only")
        print(f"wrote {write_doc(REPO / 'docs' / 'log' / 'grpo_step.md', measured, command, started, args)}")


def main() -> None:
    args = parse_args()
    if args.report_only:
        return report_only(args)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    work = Path(args.work or tempfile.mkdtemp(prefix="grpo-step-"))
    work.mkdir(parents=True, exist_ok=True)
    from hybridflow.models import resolve_model_path

    model_dir = Path(resolve_model_path(MODEL))
    train_file = make_data(work)
    trl_python = None if args.skip_trl else ensure_trl_venv()
    print(f"model {model_dir}\ndata {train_file}\nwork {work}", flush=True)

    hybridflow_runs = [
        functools.partial(run_hybridflow, args, train_file, work, rollout, layout)
        for rollout in args.rollout.split(",")
        for layout in args.layouts.split(",")
        if not args.skip_hybridflow
    ]
    trl_runs = [
        functools.partial(run_trl, args, trl_python, model_dir, train_file, work, setting)
        for setting in args.trl_precision.split(",")
        if trl_python is not None
    ]
    # Alternate the two sides, so that the first settings of each are compared early and drifts hit both alike.
    order = [run for pair in itertools.zip_longest(hybridflow_runs, trl_runs) for run in pair if run is not None]
    measured: list[Measurement] = []
    try:
        for run_once in order:
            result = measure(args, run_once)
            if result is not None:
                measured.append(result)
                save_results(work / "results.json", measured)
    except KeyboardInterrupt:
        print("\ninterrupted: reporting the runs that finished", flush=True)

    command = "python bench/grpo_step.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print_report(measured)
    if args.write_doc:
        path = write_doc(REPO / "docs" / "log" / "grpo_step.md", measured, command.strip(), started, args)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
