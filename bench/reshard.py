"""The actor's switch from its training layout (dp, t) to a generation layout (tg): bytes, time, memory.

    .venv/bin/python bench/reshard.py --world 3                           # SmolLM2-135M on 3 processes (t = 1, 3)
    .venv/bin/python bench/reshard.py --model smollm2-8h --plot docs/images/reshard.png   # 4 processes (t = 1, 2, 4)
    .venv/bin/python bench/reshard.py --model tiny-llama                  # seconds, 4 processes (t = 1, 2)

Run by hand, not a test. Each of the Ray ranks holds the model in a training layout: tensor
parallelism over t ranks (engine/tensor_parallel), FSDP2 over dp = world / t. Then, for each generation
tensor-parallel size tg dividing t, three ways to build the generation weights are timed, and the
bytes each rank received are counted from the collectives' inputs and outputs:

- gather_all (the hybrid actor before the 3D-HybridEngine, DeepSpeed-Chat's row in the paper's
  Table 2): every rank gathers every parameter in full;
- hybridflow_v (the paper's vanilla HybridFlow): gather the rank's TP shard over dp, then the full
  tensor over the training TP group, then keep the generation slice;
- hybridflow (§5.3): what a run does, `hybrid_engine/reshard.generation_weights` on the actor's
  layouts (`hybrid_engine/layout.py`): the TP shard gathered over dp, then only the missing pieces of
  the rank's generation shard, inside its gather group of t / tg ranks.

"predicted" is `regroup.predicted_switch_bytes`: Table 2's formulas for the tensor-parallel weights plus
FSDP's gather over dp of every weight (embeddings, norms and LM head are held whole by every tp rank).
"held" is the generation weights a rank holds afterwards (gathered one parameter at a time, so
hybridflow_v's full tensor exists for one parameter at once, not for the whole model as in the paper's
accounting).

With ``--pipeline 2`` the training layout is (dp, pp, t) with the model in 2 stages (engine/pipeline.py) and the
switch is the production one only. At pg = 1 every rank generates with every layer, so it gathers its own stage's
generation shard as above and the other stage's from its pp peer. Predicted: Table 2's bytes for its own stage's
weights (dp, t, tg as above), plus the other stage's generation shard whole (1/tg of its split weights, all of the
rest), from the model's parameter sizes; held: the whole model's generation shard, every layer's. With
``--generation-stages G`` (pg, dividing pp) the ranks generate in G stages: a rank receives the layers of only the
pp / G - 1 other training stages that make its generation stage, and the other stages' embeddings, final norm and
head; it holds its generation stage's layers (1/G of them) and those.

SmolLM2-135M has 9 query and 3 key/value heads, so it splits over t in {1, 3} only (``--world 3``).
``--model smollm2-8h`` is a random Llama of SmolLM2-135M's size (576 wide, 30 layers, MLP 1536, vocabulary
49152) with 8 query and 4 key/value heads, which splits over 1, 2 or 4 ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register, start_ray
from hybridflow.engine.fsdp import shard_model
from hybridflow.engine.pipeline import build_pipelined, pipeline_mesh
from hybridflow.engine.pipeline_stages import stage_layers
from hybridflow.engine.tensor_parallel import apply_tensor_parallel, training_mesh
from hybridflow.hybrid_engine.layout import ActorLayouts
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.regroup import Regrouping, predicted_switch_bytes
from hybridflow.hybrid_engine.reshard import SwitchReport, generation_weights, tensor_parallel_dim
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.models.tensor_parallel import layer_split
from hybridflow.trainer.setup.config import default_config
from hybridflow.workers.sharded_model import quiet_libraries

METHODS = ("gather_all", "hybridflow_v", "hybridflow")
# SmolLM2-135M's sizes with heads that split over 2 and 4 ranks (random weights: for bytes and timings)
SMOLLM2_8H = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}


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
        self.layouts: dict[int, ActorLayouts] = {}  # by tg

    def _tp_shard(self, param: DTensor) -> tuple[torch.Tensor, int]:
        """The rank's TP shard (or the full tensor, for a replicated weight) gathered over dp, and bytes received."""
        placements = list(param.placements)
        placements[0] = Replicate()  # FSDP's dp dimension comes first
        gathered = param.redistribute(param.device_mesh, placements).to_local()
        return gathered, local_bytes(gathered) - local_bytes(param)

    def _hybridflow(self, tg: int) -> tuple[int, list[torch.Tensor]]:
        """The production switch: hybrid_engine/reshard.py on the actor's layouts."""
        if tg not in self.layouts:  # collective: every rank builds the same groups
            shape = LayoutShape(dp=self.world_size // self.t, t=self.t, tg=tg)
            self.layouts[tg] = ActorLayouts.build(self.device, shape)
        report = SwitchReport()
        held = [
            piece for _, piece in generation_weights(self.model, torch.bfloat16, self.layouts[tg].gather_group, report)
        ]
        return report.received, held

    def _baseline(self, tg: int, method: str) -> tuple[int, list[torch.Tensor]]:
        regrouping = Regrouping(t=self.t, tg=tg)
        tp_rank = self.mesh["tp"].get_local_rank()
        received, held = 0, []
        for _, param in self.model.named_parameters():
            tensor_parallel = tensor_parallel_dim(param) is not None
            if method == "gather_all":
                full = param.full_tensor()
                received += local_bytes(full) - local_bytes(param)
                held.append(full)
                continue
            shard, got = self._tp_shard(param)
            received += got
            if not tensor_parallel:
                held.append(shard)
                continue
            pieces = [torch.empty_like(shard) for _ in range(self.t)]
            dist.all_gather(pieces, shard.contiguous(), group=self.mesh["tp"].get_group())
            full = torch.cat(pieces, dim=param.placements[1].dim)
            received += local_bytes(full) - local_bytes(shard)
            held.append(full.chunk(tg, dim=param.placements[1].dim)[regrouping.generation_shard(tp_rank)].clone())
            del full, pieces
        return received, held

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def switch(self, tg: int, method: str) -> dict[str, float]:
        if method == "hybridflow":
            self._hybridflow(tg)  # builds the groups outside the timed part
        split = [p for p in self.model.parameters() if tensor_parallel_dim(p) is not None]
        tp_bytes = sum(p.numel() * p.element_size() for p in split)
        whole_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) - tp_bytes
        dist.barrier()
        start = time.perf_counter()
        if method == "hybridflow":
            received, held = self._hybridflow(tg)
        else:
            received, held = self._baseline(tg, method)
        dist.barrier()
        seconds = time.perf_counter() - start
        dp = self.world_size // self.t
        predicted = predicted_switch_bytes(tp_bytes, whole_bytes, dp=dp, t=self.t, tg=tg, method=method)
        if method == "gather_all":
            peak_predicted = tp_bytes + whole_bytes
        else:
            peak_predicted = whole_bytes + tp_bytes / tg  # held afterwards (V's full copy is per parameter)
        return {
            "received_mb": received / 2**20,
            "predicted_mb": predicted / 2**20,
            "seconds": seconds,
            "peak_mb": sum(local_bytes(h) for h in held) / 2**20,
            "peak_predicted_mb": peak_predicted / 2**20,
        }


def stage_of(name: str, layers: int, stages: int) -> int:
    """The stage holding parameter ``name``: a decoder layer's by its index, the embedding the first, the rest (the
    final norm, an untied head) the last."""
    if name.startswith("model.layers."):
        index = int(name.split(".")[2])
        return next(s for s, kept in enumerate(stage_layers(layers, stages)) if index in kept)
    return 0 if "embed_tokens" in name else stages - 1


class StagedResharder(Worker):
    """The actor in pipeline stages, (dp, pp, t), switched to generation groups of tg by hybrid_engine/reshard.py."""

    def __init__(self, *, path: str, pp: int, t: int):
        super().__init__()
        quiet_libraries()
        self.pp, self.t, self.dp = pp, t, self.world_size // (pp * t)
        model = load_causal_lm(path, dtype=torch.bfloat16)
        split_table, layers = layer_split(model.config.model_type), model.config.num_hidden_layers
        # per stage and kind (decoder layers, the rest): (tensor-parallel bytes, the rest), bf16
        self.stage_bytes = [{kind: [0, 0] for kind in ("layers", "other")} for _ in range(pp)]
        for name, param in model.named_parameters():  # a tied head is the embedding: listed once
            split = t > 1 and split_table.shard_dim(name) is not None
            kind = "layers" if name.startswith("model.layers.") else "other"
            self.stage_bytes[stage_of(name, layers, pp)][kind][0 if split else 1] += param.numel() * 2
        mesh = pipeline_mesh(self.device, self.dp, pp, t)
        fsdp = default_config().actor_rollout_ref.actor.fsdp

        def shard(part: torch.nn.Module) -> torch.nn.Module:
            apply_tensor_parallel(part, mesh["tp"])
            return shard_model(part, mesh["dp"], dataclasses.replace(fsdp, host_collectives=False))

        self.model = build_pipelined(model, mesh, shard, stages_per_rank=1, activation_dtype=torch.bfloat16)
        self.layouts: dict[int, ActorLayouts] = {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def switch(self, tg: int, pg: int = 1) -> dict[str, float]:
        if (tg, pg) not in self.layouts:  # collective: every rank builds the same groups
            shape = LayoutShape(dp=self.dp, t=self.t, tg=tg, pp=self.pp, pg=pg)
            self.layouts[tg, pg] = ActorLayouts.build(self.device, shape)
        layouts = self.layouts[tg, pg]
        dist.barrier()
        start = time.perf_counter()
        report = SwitchReport()
        weights = generation_weights(
            self.model, torch.bfloat16, layouts.gather_group, report, stage_gather_group=layouts.stage_gather_group
        )
        held = list(weights)
        dist.barrier()
        seconds = time.perf_counter() - start
        own = self.model.indices[0]
        n = self.pp // pg
        block = range(own // n * n, own // n * n + n)  # the training stages of this rank's generation stage

        def shard(stage: int, kinds: tuple[str, ...] = ("layers", "other")) -> float:
            return sum(self.stage_bytes[stage][kind][0] / tg + self.stage_bytes[stage][kind][1] for kind in kinds)

        def received_from(stage: int) -> float:
            return shard(stage) if stage in block else shard(stage, ("other",))

        split, whole = (sum(self.stage_bytes[own][kind][i] for kind in ("layers", "other")) for i in (0, 1))
        predicted = predicted_switch_bytes(split, whole, dp=self.dp, t=self.t, tg=tg, method="hybridflow")
        predicted += sum(received_from(stage) for stage in range(self.pp) if stage != own)
        return {
            "received_mb": report.received / 2**20,
            "predicted_mb": predicted / 2**20,
            "seconds": seconds,
            "peak_mb": sum(local_bytes(tensor) for _, tensor in held) / 2**20,
            "peak_predicted_mb": sum(received_from(stage) for stage in range(self.pp)) / 2**20,
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


def model_path(name: str) -> str:
    if name == "smollm2-8h":
        return str(resolve_model_path("tiny-llama", **SMOLLM2_8H))
    return str(resolve_model_path(name))


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Two panels: MB received per rank and generation weights held, by layout and method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layouts_seen = list(dict.fromkeys((r["dp"], r["t"], r["tg"]) for r in rows))
    figure = Figure(figsize=(10, 4))
    FigureCanvasAgg(figure)
    width = 0.8 / len(METHODS)
    for index, (key, label) in enumerate((("received_mb", "MB received per rank"), ("peak_mb", "generation MB held"))):
        axes = figure.add_subplot(1, 2, index + 1)
        for m, method in enumerate(METHODS):
            values = [
                next(r[key] for r in rows if (r["dp"], r["t"], r["tg"]) == lay and r["method"] == method)
                for lay in layouts_seen
            ]
            axes.bar([i + m * width for i in range(len(layouts_seen))], values, width, label=method)
        axes.set_xticks([i + width for i in range(len(layouts_seen))])
        axes.set_xticklabels([f"dp{dp} t{t}\ntg{tg}" for dp, t, tg in layouts_seen], fontsize=8)
        axes.set_ylabel(label)
        axes.grid(axis="y", alpha=0.3)
    figure.axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, or smollm2-8h")
    parser.add_argument("--world", type=int, default=4, help="processes (ranks)")
    parser.add_argument("--repeats", type=int, default=3, help="switches timed per case (median)")
    parser.add_argument("--plot", type=Path, default=None, help="write the bytes and memory chart here (PNG)")
    parser.add_argument("--pipeline", type=int, default=1, help="pipeline stages of the training layout (pp)")
    parser.add_argument(
        "--generation-stages", type=int, default=1, help="pipeline stages of the generation layout (pg, dividing pp)"
    )
    args = parser.parse_args()
    if args.pipeline > 1:
        staged(model_path(args.model), args.world, args.pipeline, args.repeats, args.generation_stages)
        return
    path = model_path(args.model)
    print(f"{args.model}, {args.world} processes, bf16 weights; load {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    print(f"{'dp':>3} {'t':>3} {'tg':>3} {'method':<13} {'MB/rank':>9} {'predicted':>10} {'s/switch':>9}", end="")
    print(f" {'held MB':>8} {'pred.':>8} {'time/gather_all':>16}")
    rows = []
    spec = lambda t: (Resharder, {"path": path, "t": t})  # noqa: E731
    for t, tgs, group in groups_by_t(args.world, layouts(path, args.world), spec):
        for tg in tgs:
            baseline = None
            for method in METHODS:
                runs = [group.switch(tg, method)[0] for _ in range(args.repeats)]
                row = runs[-1] | {"seconds": sorted(r["seconds"] for r in runs)[len(runs) // 2]}
                baseline = baseline or row["seconds"]
                rows.append(row | {"dp": args.world // t, "t": t, "tg": tg, "method": method})
                print(
                    f"{args.world // t:>3} {t:>3} {tg:>3} {method:<13} {row['received_mb']:>9.2f} "
                    f"{row['predicted_mb']:>10.2f} {row['seconds']:>9.3f} {row['peak_mb']:>8.1f} "
                    f"{row['peak_predicted_mb']:>8.1f} {row['seconds'] / baseline:>16.2f}",
                    flush=True,
                )
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.plot is not None:
        plot(rows, args.plot, f"switch to the generation layout: {args.model} (bf16) on {args.world} processes")
        print(f"plot: {args.plot}")


def groups_by_t(world: int, pairs: list[tuple[int, int]], spec) -> Iterator[tuple[int, list[int], RayWorkerGroup]]:
    """(t, its tgs, a group of ``world`` ranks of ``spec(t)``'s (worker class, kwargs)) for each t of the (t, tg)
    ``pairs``, on a local Ray cluster started here unless one runs; each group ends before the next starts."""
    by_t: dict[int, list[int]] = {}
    for t, tg in pairs:
        by_t.setdefault(t, []).append(tg)
    started = start_ray(num_cpus=world)
    try:
        for t, tgs in by_t.items():
            pool = RayResourcePool([world], cpus_per_worker=1.0)
            worker, kwargs = spec(t)
            group = RayWorkerGroup(pool, RoleSpec(worker, kwargs=kwargs))
            yield t, tgs, group
            group.kill()
            pool.release()
    finally:
        if started:
            ray.shutdown()


def staged(path: str, world: int, pp: int, repeats: int, pg: int = 1) -> None:
    """The switch of a pipeline-staged actor, (dp, pp, t) for every t the model and the processes allow, to
    generation groups of pg stages x tg."""
    load = f"load {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)"
    print(f"{path}, {world} processes, pp {pp}, pg {pg}, bf16 weights; {load}")
    header = f"{'dp':>3} {'pp':>3} {'pg':>3} {'t':>3} {'tg':>3} {'MB/rank':>9} {'predicted':>10}"
    print(f"{header} {'s/switch':>9} {'held MB':>8} {'pred.':>8}")
    spec = lambda t: (StagedResharder, {"path": path, "pp": pp, "t": t})  # noqa: E731
    for t, tgs, group in groups_by_t(world, layouts(path, world // pp), spec):
        for tg in tgs:
            runs = [group.switch(tg, pg) for _ in range(repeats)]
            seconds = sorted(max(r["seconds"] for r in ranks) for ranks in runs)[len(runs) // 2]
            for rank, row in enumerate(runs[-1]):  # each stage's ranks receive the other stage's share
                print(
                    f"{world // (pp * t):>3} {pp:>3} {pg:>3} {t:>3} {tg:>3} {row['received_mb']:>9.2f} "
                    f"{row['predicted_mb']:>10.2f} {seconds:>9.3f} {row['peak_mb']:>8.1f} "
                    f"{row['peak_predicted_mb']:>8.1f}   rank {rank}",
                    flush=True,
                )
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
