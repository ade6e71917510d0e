"""The actor's switch from its training layout (dp, t) to a generation layout (tg): bytes, time, memory.

    .venv/bin/python bench/reshard.py --world 3             # smollm2-135m on 3 processes (t = 1, 3)
    .venv/bin/python bench/reshard.py --model tiny-llama    # 4 processes (t = 1, 2)

Run by hand, not a test. Each of the Ray ranks holds the model in a training layout: tensor
parallelism over t ranks (engine/tensor_parallel), FSDP2 over dp = world / t. Then, for each generation
tensor-parallel size tg dividing t, three ways to build the generation weights are timed, and the
bytes each rank received are counted from the collectives' inputs and outputs:

- gather_all (what the hybrid actor does today, DeepSpeed-Chat's row in the paper's Table 2):
  every rank gathers every parameter in full;
- hybridflow_v (the paper's vanilla HybridFlow): gather the rank's TP shard over dp, then the full
  tensor over the training TP group, then keep the generation slice;
- hybridflow (§5.3, hybrid_engine/regroup.py): gather the TP shard over dp, then only the missing
  pieces of the rank's generation shard, inside its gather group of t / tg ranks.

"predicted" is `regroup.switch_bytes` for the tensor-parallel weights (the formulas of Table 2 plus
FSDP's gather over dp) plus the replicated weights' FSDP gather (embeddings, norms, LM head, which
every method holds in full). "peak" is the generation weights a rank holds afterwards (gathered
one parameter at a time, so hybridflow_v's full tensor exists for one parameter at once, not for
the whole model as in the paper's accounting).

t runs over the divisors of the process count that split the model's heads evenly: SmolLM2-135M has
9 query and 3 key/value heads, so it takes t in {1, 3} (``--world 3``); tiny-llama t in {1, 2, 4}.
"""

from __future__ import annotations

import argparse
import os
import time

import ray
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register, start_ray
from hybridflow.engine.fsdp import shard_model
from hybridflow.engine.tensor_parallel import apply_tensor_parallel, training_mesh
from hybridflow.hybrid_engine.regroup import Regrouping, gather_generation_shard, new_gather_groups, switch_bytes
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.trainer.config import default_config
from hybridflow.workers.sharded_model import quiet_libraries


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


class Resharder(Worker):
    def __init__(self, *, path: str, t: int):
        super().__init__()
        quiet_libraries()
        self.t = t
        self.mesh = training_mesh(self.device, self.world_size // t, t)
        model = load_causal_lm(path, dtype=torch.bfloat16)
        apply_tensor_parallel(model, self.mesh["tp"])
        fsdp = default_config().actor_rollout_ref.actor.fsdp
        self.model = shard_model(model, self.mesh["dp"], fsdp)
        self.tp_groups = self.mesh.mesh.tolist()  # row i: the global ranks of dp index i's TP group

    def _tp_shard(self, param: DTensor) -> tuple[torch.Tensor, int]:
        """The rank's TP shard (or the full tensor, for a replicated weight) gathered over dp, and bytes received."""
        placements = list(param.placements)
        placements[0] = Replicate()  # FSDP's dp dimension comes first
        gathered = param.redistribute(param.device_mesh, placements).to_local()
        return gathered, local_bytes(gathered) - local_bytes(param)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def switch(self, tg: int, method: str) -> dict[str, float]:
        regrouping = Regrouping(t=self.t, tg=tg)
        groups = new_gather_groups(regrouping, self.tp_groups) if method == "hybridflow" else []
        tp_rank = self.mesh["tp"].get_local_rank()
        my_group = None
        if groups:
            my_group = groups[self.mesh["dp"].get_local_rank() * tg + regrouping.generation_shard(tp_rank)]
        dist.barrier()
        start = time.perf_counter()
        received = tp_bytes = replicated_bytes = 0
        held = []
        for _, param in self.model.named_parameters():
            tensor_parallel = param.device_mesh.ndim == 2 and any(p.is_shard() for p in param.placements[1:])
            full_bytes = param.numel() * param.element_size()
            if method == "gather_all":
                full = param.full_tensor()
                received += local_bytes(full) - local_bytes(param)
                held.append(full)
            else:
                shard, got = self._tp_shard(param)
                received += got
                if not tensor_parallel:
                    held.append(shard)
                elif method == "hybridflow_v":
                    pieces = [torch.empty_like(shard) for _ in range(self.t)]
                    dist.all_gather(pieces, shard.contiguous(), group=self.mesh["tp"].get_group())
                    full = torch.cat(pieces, dim=param.placements[1].dim)
                    received += local_bytes(full) - local_bytes(shard)
                    held.append(full.chunk(tg, dim=param.placements[1].dim)[regrouping.generation_shard(tp_rank)])
                    del full, pieces
                else:
                    generation = gather_generation_shard(shard, param.placements[1].dim, my_group)
                    received += local_bytes(generation) - local_bytes(shard)
                    held.append(generation)
            if tensor_parallel:
                tp_bytes += full_bytes
            else:
                replicated_bytes += full_bytes
        dist.barrier()
        seconds = time.perf_counter() - start
        peak = sum(local_bytes(h) for h in held)
        dp = self.world_size // self.t
        predicted = switch_bytes(tp_bytes, dp=dp, t=self.t, tg=tg, method=method)
        predicted += replicated_bytes * (dp - 1) / dp  # replicated over tp, sharded over dp, in every method
        if method == "gather_all":
            peak_predicted = tp_bytes + replicated_bytes
        else:
            peak_predicted = replicated_bytes + tp_bytes / tg  # held afterwards (V's full copy is per parameter)
        return {
            "received_mb": received / 2**20,
            "predicted_mb": predicted / 2**20,
            "seconds": seconds,
            "peak_mb": peak / 2**20,
            "peak_predicted_mb": peak_predicted / 2**20,
        }


def layouts(path: str, world: int) -> list[tuple[int, int]]:
    """(t, tg) pairs: t divides the process count and splits the model's heads, tg divides t."""
    from transformers import AutoConfig

    from hybridflow.models.split_sizes import check_tensor_parallel_size

    config = AutoConfig.from_pretrained(path)
    pairs = []
    for t in range(1, world + 1):
        try:
            check_tensor_parallel_size(config, t, "t")
        except ValueError:
            continue
        if world % t == 0:
            pairs += [(t, tg) for tg in range(1, t + 1) if t % tg == 0]
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--world", type=int, default=4, help="processes (ranks)")
    parser.add_argument("--repeats", type=int, default=3, help="switches timed per case (median)")
    args = parser.parse_args()
    path = str(resolve_model_path(args.model))
    print(f"{args.model}, {args.world} processes, bf16 weights; load {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    started = start_ray(num_cpus=args.world)
    print(f"{'dp':>3} {'t':>3} {'tg':>3} {'method':<13} {'MB/rank':>9} {'predicted':>10} {'s/switch':>9}", end="")
    print(f" {'peak MB':>8} {'pred.':>8}")
    try:
        by_t: dict[int, list[int]] = {}
        for t, tg in layouts(path, args.world):
            by_t.setdefault(t, []).append(tg)
        for t, tgs in by_t.items():
            pool = RayResourcePool([args.world], cpus_per_worker=1.0)
            group = RayWorkerGroup(pool, RoleSpec(Resharder, kwargs={"path": path, "t": t}))
            for tg in tgs:
                for method in ("gather_all", "hybridflow_v", "hybridflow"):
                    runs = [group.switch(tg, method)[0] for _ in range(args.repeats)]
                    row = runs[-1] | {"seconds": sorted(r["seconds"] for r in runs)[len(runs) // 2]}
                    print(
                        f"{args.world // t:>3} {t:>3} {tg:>3} {method:<13} {row['received_mb']:>9.2f} "
                        f"{row['predicted_mb']:>10.2f} {row['seconds']:>9.3f} {row['peak_mb']:>8.1f} "
                        f"{row['peak_predicted_mb']:>8.1f}",
                        flush=True,
                    )
            group.kill()
            pool.release()
    finally:
        if started:
            ray.shutdown()
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
