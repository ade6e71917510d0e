"""GRPO steps of the actor in the 3D-HybridEngine's layouts (run by hand, not a test).

    .venv/bin/python bench/layouts.py --model smollm2-135m-instruct --world 3   # t=1 | t=3, tg=1 | t=3, tg=3
    .venv/bin/python bench/layouts.py --model smollm2-8h --world 2              # t=1 | t=2, tg=1 | t=2, tg=2

One invocation runs the same GRPO job (the arithmetic task, ``--prompts`` x 4 samples, ``--response-length``
new tokens, one torch thread per rank) as real ``hybridflow train`` runs on ``--world`` ranks in three
layouts: data parallel (t = 1), the actor's layers split over all ranks in training but generation from
a whole copy per rank (t = world, tg = 1), and split in both (t = tg = world). It prints the median over
the steps after the first of the step and its stages, what the switch moved and the generation weights
a rank holds, the peak memory of a rank, and each step time as a ratio to t = 1's from the same
invocation.

SmolLM2-135M splits over 1 or 3 ranks only (9 query, 3 key/value heads); ``smollm2-8h`` is a random
Llama of its size with 8 query / 4 key/value heads (bench/reshard.py), which splits over 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from reshard import model_path

from hybridflow.data.tasks import write_task

COLUMNS = {  # metric: column title
    "timing_s/step": "s/step",
    "timing_s/gen": "gen s",
    "timing_s/weight_sync": "switch s",
    "timing_s/old_log_prob": "old lp s",
    "timing_s/update_actor": "update s",
    "switch/received_mb": "MB recv",
    "switch/generation_weights_mb": "gen MB",
    "perf/max_memory_gb": "peak GB",
}


def run(
    args: argparse.Namespace, path: str, t: int, tg: int, data: Path, run_dir: Path, extra: tuple[str, ...] = ()
) -> list[dict]:
    """A real run's metrics; ``extra``: more key=value settings (another algorithm, placement)."""
    overrides = [
        f"data.train_files=[{data / 'train.parquet'}]",
        "data.val_files=[]",
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.model.path={path}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.reuse_update_log_probs=false",  # time the old log-prob pass too
        "actor_rollout_ref.rollout.n=4",
        f"actor_rollout_ref.rollout.response_length={args.response_length}",
        f"actor_rollout_ref.actor.tensor_model_parallel_size={t}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tg}",
        f"trainer.n_workers_per_node={args.world}",
        "trainer.cpus_per_worker=1",
        "trainer.val_before_train=false",
        "trainer.total_epochs=100",
        f"trainer.total_training_steps={args.steps}",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]
    print(f"t={t} tg={tg} {' '.join(extra)}: {args.steps} steps ...", flush=True)
    subprocess.run(
        [sys.executable, "-m", "hybridflow.trainer.commands.train", *overrides], check=True, stdout=subprocess.DEVNULL
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, or smollm2-8h")
    parser.add_argument("--world", type=int, default=3, help="ranks of the actor")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per step (x 4 samples)")
    parser.add_argument("--response-length", type=int, default=48)
    args = parser.parse_args()
    path = model_path(args.model)
    layouts = [(1, 1), (args.world, 1), (args.world, args.world)]
    print(f"{args.model} on {args.world} ranks; load before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_task("arithmetic", data, train=256, test=8, seed=0)
        for t, tg in layouts:
            results[t, tg] = run(args, path, t, tg, data, Path(tmp) / f"t{t}_tg{tg}")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"{'layout':<12}" + "".join(f"{title:>10}" for title in COLUMNS.values()) + f"{'step / t1':>11}")
    baseline = None
    for (t, tg), metrics in results.items():
        later = metrics[1:] or metrics  # the first step warms caches up
        row = {key: statistics.median(r.get(key, 0.0) for r in later) for key in COLUMNS}
        baseline = baseline or row["timing_s/step"]
        cells = "".join(f"{row[key]:>10.2f}" for key in COLUMNS)
        print(f"{f't={t} tg={tg}':<12}{cells}{row['timing_s/step'] / baseline:>11.2f}")


if __name__ == "__main__":
    main()
