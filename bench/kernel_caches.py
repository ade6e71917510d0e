"""torch's per-shape CPU kernel caches against a worker's memory and speed (run by hand, not a test).

    .venv/bin/python bench/kernel_caches.py                                   # tiny-llama, 40 steps
    .venv/bin/python bench/kernel_caches.py --model smollm2-135m-instruct --steps 12

In one process per variant (no Ray; 1 thread; the workers' allocator settings): the actor worker's
loop of ``generate_sequences`` and ``update_actor`` on the arithmetic task (8 prompts x 4 samples,
32 new tokens, GRPO advantages), with both kernel caches (``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and
ideep's ``LRU_CACHE_CAPACITY``) at 1024 (torch's default), 1 (off) and 64 (hybridflow's default,
``trainer.cpu_kernel_cache_capacity``). Prints the resident set at the first and last step, the
growth per step, and the median seconds per step after 3 as a ratio to the default caches'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from hybridflow.controller.ray_runtime import ALLOCATOR_ENV, kernel_cache_env

CAPACITIES = (1024, 1, 64)  # 1: effectively off (ideep crashes with 0)


def loop(model: str, steps: int, data_dir: str) -> dict:
    """In this process: resident GiB and seconds of each step."""
    import time

    import numpy as np
    import torch

    from hybridflow.algorithms import get_adv_estimator
    from hybridflow.batch_keys import ADVANTAGES, GLOBAL_STEP, METRICS, PROMPT_TENSORS, RESPONSE_MASK, SAMPLING, UID
    from hybridflow.data import PromptDataLoader, RLHFDataset
    from hybridflow.hybrid_engine.layout_shape import LayoutShape
    from hybridflow.models import load_tokenizer, resolve_model_path
    from hybridflow.procfs import resident_gb
    from hybridflow.reward import RewardManager
    from hybridflow.trainer.setup.config import load_config
    from hybridflow.workers import ActorRolloutWorker

    torch.set_num_threads(1)
    config = load_config(
        [
            f"actor_rollout_ref.model.path={resolve_model_path(model)}",
            f"data.train_files=[{data_dir}/train.parquet]",
            "actor_rollout_ref.rollout.response_length=32",
        ]
    )
    arr = config.actor_rollout_ref
    worker = ActorRolloutWorker(
        config=arr,
        model_path=arr.model.path,
        layout=LayoutShape(dp=1, t=1, tg=1),
        tool_config="",
        default_agent=arr.rollout.multi_turn.default_agent,
        mini_batch_per_rank=arr.actor.ppo_mini_batch_size * arr.rollout.n,
        total_training_steps=1000,
        seed=0,
    )
    tokenizer = load_tokenizer(config.actor_rollout_ref.model.path)
    batches = iter(PromptDataLoader(RLHFDataset(config.data.train_files, tokenizer, config.data), 8, seed=0))
    reward, estimator, n = RewardManager(tokenizer, config.reward), get_adv_estimator("grpo"), 4
    resident, seconds = [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        prompts = next(batches)
        prompts.non_tensor_batch[UID] = np.array([f"{step}-{i}" for i in range(len(prompts))], dtype=object)
        request = prompts.pop(batch_keys=list(PROMPT_TENSORS))
        request.meta_info = {GLOBAL_STEP: step, SAMPLING: "train"}
        generated = worker.generate_sequences(request.repeat(n, interleave=True))
        generated.meta_info.pop(METRICS)
        batch = prompts.repeat(n, interleave=True).union(generated)
        batch.meta_info = {GLOBAL_STEP: step}
        scores = reward(batch).token_level_scores
        uids = batch.non_tensor_batch[UID]
        batch.batch[ADVANTAGES], _ = estimator(scores, batch.batch[RESPONSE_MASK].float(), uids, config.algorithm)
        worker.update_actor(batch)
        seconds.append(time.perf_counter() - start)
        resident.append(resident_gb())
    return {"resident": resident, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # data_dir, output file: one variant
    args = parser.parse_args()
    if args.child:
        with open(args.child[1], "w") as file:
            json.dump(loop(args.model, args.steps, args.child[0]), file)
        return
    from hybridflow.data.tasks import write_task

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        write_task("arithmetic", scratch, train=2000, test=10, seed=0)
        for capacity in CAPACITIES:
            print(f"caches at {capacity} ...", flush=True)
            out = os.path.join(scratch, f"{capacity}.json")
            env = {**os.environ, **ALLOCATOR_ENV, **kernel_cache_env(capacity)}
            command = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps)]
            subprocess.run([*command, "--child", scratch, out], env=env, check=True, stdout=subprocess.DEVNULL)
            with open(out) as file:
                results[capacity] = json.load(file)
    base = statistics.median(results[1024]["seconds"][3:])
    print(f"\n{args.model}, {args.steps} steps")
    print("| caches | step 1 (GiB) | last (GiB) | MB/step | s/step (median after 3) | vs 1024 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for capacity, result in results.items():
        resident, median = result["resident"], statistics.median(result["seconds"][3:])
        growth = (resident[-1] - resident[0]) / (len(resident) - 1) * 1024
        cells = [capacity, f"{resident[0]:.2f}", f"{resident[-1]:.2f}", f"{growth:+.1f}", f"{median:.2f}"]
        print("| " + " | ".join(map(str, cells)) + f" | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
