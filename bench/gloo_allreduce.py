"""The cost of one all-reduce of a decode step's activations between processes on this machine (by hand).

    .venv/bin/python bench/gloo_allreduce.py            # 2 processes, (24, 576) bf16: 24 sequences x SmolLM2's width
    .venv/bin/python bench/gloo_allreduce.py --world 3 --rows 64

Tensor-parallel generation does two all-reduces per layer per decode step (rollout/native/parallel.py),
so this number times 2 x layers is what tensor parallelism adds to every generated token here.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.controller.worker import free_port


def measure(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    x = torch.randn(args.rows, args.width).bfloat16()
    for _ in range(50):  # warm-up
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.repeats):
        dist.all_reduce(x)
    seconds = (time.perf_counter() - start) / args.repeats
    if rank == 0:
        print(
            f"all_reduce of ({args.rows}, {args.width}) bf16 over {args.world} gloo processes: {seconds * 1e6:.0f} us"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=1000)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    mp.spawn(measure, args=(args, free_port()), nprocs=args.world)


if __name__ == "__main__":
    main()
