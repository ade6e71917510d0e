"""What generating in pipeline stages costs: the native engine on SmolLM2-135M in 2 stages (pg = 2) against the same
2 processes generating as 2 replicas (pg = 1), and one process alone (run by hand).

    .venv/bin/python bench/generation_stages.py                  # 64 prompts, 64 new tokens, 3 repeats

Each case is a fresh group of 2 processes (gloo, one thread each; "alone": rank 0 generates, rank 1 waits) running
rollout/native with the default dtype (bf16 where the host has bf16 units): the same ``--prompts`` prompts of 32
tokens, ``--new-tokens`` new tokens each (no stop token), timed after a warm-up call (the median of ``--repeats``).

- pg 2: one generation group of both ranks, each holding 15 of the 30 layers and their KV cache; both take every
  prompt, the stages compute one after another (rollout/native/stages.py), and the hidden states cross between the
  ranks each step.
- pg 1: each rank holds every layer and generates half the prompts.
- alone: one rank holds every layer and generates every prompt (one core).

Printed: tokens/s of each case and the ratios, and each rank's weight and KV-cache bytes: pg 2 trades the speed of
a replica per rank for half the memory a rank needs; beside them the planner's generation seconds for pg 1 and pg 2
(planner/cost.py ``generation_seconds``, the ``cpu`` preset, calibrated where ``hybridflow plan --calibrate`` has
measured this machine). The load average is printed with the results.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeRollout
from hybridflow.trainer.setup.config import default_config
from hybridflow.workers.sharded_model import quiet_libraries

MODEL = "smollm2-135m-instruct"
PROMPT_TOKENS = 32


def _case(rank: int, mode: str, prompts: int, new_tokens: int, repeats: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    quiet_libraries()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        path = str(resolve_model_path(MODEL))
        model = load_causal_lm(path)
        engine_config = default_config().actor_rollout_ref.rollout.native
        stages = dist.group.WORLD if mode == "pg 2" else None
        rollout = NativeRollout(
            model, load_tokenizer(path), engine_config=engine_config, stop_token_ids=[], pp_group=stages
        )
        del model
        generator = torch.Generator().manual_seed(0)
        every = torch.randint(100, 20000, (prompts, PROMPT_TOKENS), generator=generator).tolist()
        mine = {"pg 2": every, "pg 1": every[rank::2], "alone": every if rank == 0 else []}[mode]
        params = SamplingParams(
            do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new_tokens, seed=rank
        )
        seconds = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if mine:
                rollout.generate_tokens(mine, params)
            dist.barrier()  # the case ends when every rank is done
            seconds.append(time.perf_counter() - start)
        engine = rollout.engine
        held = [engine.weights.nbytes(), engine.cache.nbytes() if engine.cache is not None else 0]
        gathered = [None, None]
        dist.all_gather_object(gathered, [statistics.median(seconds[1:]), *held])
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def predicted_seconds(pg: int, prompts: int, new_tokens: int) -> float:
    """The planner's seconds for the call at pg on 2 ranks (pp = 2: the stages generation regroups)."""
    from hybridflow.controller import Role
    from hybridflow.hybrid_engine.layout_shape import LayoutShape
    from hybridflow.models import model_config
    from hybridflow.planner.cluster import cluster_preset
    from hybridflow.planner.cost import generation_seconds
    from hybridflow.planner.workload import Workload, shape_from_hf

    shape = shape_from_hf(model_config(resolve_model_path(MODEL)), MODEL)
    workload = Workload(
        models={Role.ActorRollout: shape},
        prompts=prompts,
        n=1,
        prompt_length=PROMPT_TOKENS,
        response_length=new_tokens,
        micro_batch=1,
    )
    return generation_seconds(shape, LayoutShape(dp=1, t=1, tg=1, pp=2, pg=pg), workload, cluster_preset("cpu"))


def measure(mode: str, prompts: int, new_tokens: int, repeats: int) -> list[list[float]]:
    """Per rank: [seconds of a call, weight bytes, KV-cache bytes]."""
    with tempfile.TemporaryDirectory() as directory:
        init, out = Path(directory) / "init", Path(directory) / "result.pt"
        mp.spawn(_case, args=(mode, prompts, new_tokens, repeats, str(init), str(out)), nprocs=2)
        return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{MODEL}, {args.prompts} prompts x {args.new_tokens} new tokens; load {os.getloadavg()[0]:.2f}")
    print(f"{'case':<6} {'s/call':>8} {'tokens/s':>9} {'vs pg 1':>8} {'weights MB/rank':>16} {'cache MB/rank':>14}")
    tokens = args.prompts * args.new_tokens
    results = {mode: measure(mode, args.prompts, args.new_tokens, args.repeats) for mode in ("pg 1", "pg 2", "alone")}
    baseline = max(rank[0] for rank in results["pg 1"])
    for mode, ranks in results.items():
        seconds = max(rank[0] for rank in ranks)
        weights = ranks[0][1] / 2**20
        cache = ranks[0][2] / 2**20
        print(
            f"{mode:<6} {seconds:>8.2f} {tokens / seconds:>9.0f} {baseline / seconds:>7.2f}x {weights:>16.1f} "
            f"{cache:>14.1f}"
        )
    one, two = (predicted_seconds(pg, args.prompts, args.new_tokens) for pg in (1, 2))
    print(f"planner: pg 1 {one:.2f} s, pg 2 {two:.2f} s ({one / two:.2f}x pg 1's tokens/s at pg 2)")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
