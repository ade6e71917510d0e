"""The switch's data movement: this rank's generation weights, built from the training shards (§5.3).

Parameter by parameter (those that FSDP2 alone shards a bucket at a time), each rank
1. casts its training shard to the generation dtype (so that bf16, not the fp32 masters, travels),
2. gathers it over the data-parallel ranks (FSDP2's shard → the rank's tensor-parallel shard, or the
   whole tensor for weights that tensor parallelism does not split; weights that FSDP2 alone shards go
   together in one all-gather per bucket (64 MiB whole, as between pools), through shared memory where the
   ranks share a host: engine/host_collectives.py),
3. for a tensor-parallel weight, gathers the missing pieces of its generation shard from its gather
   group (layout.py) — nothing, when tg = t.

The result is exactly the slice the generation engine holds: both follow the model family's table
(models/tensor_parallel.py), and a weight whose training split disagrees with the table is refused.
`SwitchReport` counts what moved, for the switch's metrics and for the paper's formulas
(regroup.predicted_switch_bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybridflow.engine.host_collectives import host_collectives_for
from hybridflow.engine.lora import adapter_tensors, base_parameters, policy_buffers, policy_parameters
from hybridflow.engine.pipeline import PipelinedModel
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.regroup import gather_generation_shard, predicted_switch_bytes
from hybridflow.hybrid_engine.transfer_plan import DEFAULT_BUCKET_BYTES
from hybridflow.models.tensor_parallel import layer_split


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class SwitchReport:
    """What one switch moved and built on this rank (bytes, generation dtype)."""

    received: int = 0  # from other ranks
    split: int = 0  # whole size of the tensor-parallel weights (of this rank's pipeline stages)
    whole: int = 0  # whole size of the weights every tp rank holds in full (of this rank's pipeline stages)
    experts: int = 0  # whole size of the expert weights split over the ep ranks (expert parallelism), of ``whole``
    held: int = 0  # the generation weights this rank was given: its generation shard
    from_stages: int = 0  # of ``received``: the generation shards of the stages other pp ranks hold

    def predicted(self, shape: LayoutShape) -> float:
        """What ``received`` must be by the paper's formulas for this rank's stages, plus the other stages' generation
        shards as they arrived from their pp ranks (pg = 1: all of each; pg > 1: the layers of those that make the
        rank's generation stage, and the embeddings, the final norm and the head of every other). Expert weights
        come from the ep ranks that split them (each of the dp / ep replicas holds them all): 1 - 1 / ep of them."""
        others = self.whole - self.experts
        own = predicted_switch_bytes(self.split, others, dp=shape.fsdp, t=shape.t, tg=shape.tg, method="hybridflow")
        return own + self.experts * (shape.ep - 1) / shape.ep + self.from_stages


def tensor_parallel_dim(tensor: DTensor) -> int | None:
    """The dimension the training layout splits over its "tp" mesh dimension (None: not split there)."""
    names = tensor.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None
    placement = tensor.placements[names.index("tp")]
    return placement.dim if placement.is_shard() else None


def _check_split(model_type: str, name: str, dim: int) -> None:
    """ValueError unless the family's table (models/tensor_parallel.py), which the generation engine slices
    by, splits ``name`` along the dimension ``dim`` that the training layout splits."""
    expected = layer_split(model_type).shard_dim(name)
    if expected != dim:
        raise ValueError(
            f"{name}: the training layout splits dimension {dim}, the {model_type} table of "
            f"models/tensor_parallel.py (which the generation engine slices by) dimension {expected}"
        )


def unshard_data_parallel(tensor: DTensor) -> torch.Tensor:
    """The rank's tensor-parallel shard (or the whole tensor): every mesh dimension but "tp" gathered."""
    names = tensor.device_mesh.mesh_dim_names or ()
    placements = [p if name == "tp" else Replicate() for name, p in zip(names, tensor.placements)]
    return tensor.redistribute(tensor.device_mesh, placements).to_local()


def generation_weights(
    model: nn.Module,
    dtype: torch.dtype,
    gather_group: dist.ProcessGroup | None,
    report: SwitchReport,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    stage_gather_group: dist.ProcessGroup | None = None,
    cast_whole: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, this rank's generation slice in ``dtype``) for every parameter and buffer,
    one at a time (those that FSDP2 alone shards gathered ``bucket_bytes`` at a time); ``report`` accumulates
    the bytes. A LoRA model's weights come merged. ``stage_gather_group``: with generation stages, the pp ranks whose
    training stages make this rank's generation stage (``ActorLayouts``): only their decoder layers come.
    ``cast_whole=False``: a tensor this rank holds whole (an unsharded model, or one rank's) comes as trained, for a
    rollout that casts as it copies (``Rollout.load_casts``): the same values, without a cast copy of every weight."""
    if isinstance(model, PipelinedModel):
        yield from _over_stages(model, policy_parameters, dtype, gather_group, report, bucket_bytes, stage_gather_group)
        yield from _buffers(model.stages[0])  # every stage holds the same (the rotary embedding's)
        return
    yield from _generation_slices(
        model, policy_parameters(model), dtype, gather_group, report, bucket_bytes, cast_whole=cast_whole
    )
    yield from _buffers(model)


def base_generation_weights(
    model: nn.Module,
    dtype: torch.dtype,
    gather_group: dist.ProcessGroup | None,
    report: SwitchReport,
    stage_gather_group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``generation_weights`` of a LoRA model's frozen base (its adapters left out): sent to a rollout once."""
    if isinstance(model, PipelinedModel):
        yield from _over_stages(
            model, base_parameters, dtype, gather_group, report, stage_gather_group=stage_gather_group
        )
        yield from _buffers(model.stages[0])
        return
    yield from _generation_slices(model, base_parameters(model), dtype, gather_group, report)
    yield from _buffers(model)


def adapter_generation_weights(
    model: nn.Module,
    dtype: torch.dtype,
    gather_group: dist.ProcessGroup | None,
    report: SwitchReport,
    stage_gather_group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA model's adapters, this rank's generation slices of them, under the names they travel by
    (models/adapters.py): all of the policy that changes after an update. Hundreds of small tensors: those
    that only FSDP2 shards (over dp, by rows) travel together, a bucket per collective (``_generation_slices``)."""
    if isinstance(model, PipelinedModel):
        yield from _over_stages(
            model, adapter_tensors, dtype, gather_group, report, stage_gather_group=stage_gather_group
        )
        return
    yield from _generation_slices(model, adapter_tensors(model), dtype, gather_group, report)


def _sharded_by_rows_only(tensor: torch.Tensor) -> bool:
    """A DTensor split by rows over one mesh dimension (FSDP2's dp) and whole on every other one."""
    if not isinstance(tensor, DTensor):
        return False
    shards = [p for p in tensor.placements if not isinstance(p, Replicate)]
    return len(shards) == 1 and shards[0].is_shard(0) and type(shards[0]) is Shard


def _row_mesh_dim(tensor: DTensor) -> int:
    """The mesh dimension whose ranks share the rows of a tensor that ``_sharded_by_rows_only`` accepts."""
    return next(i for i, p in enumerate(tensor.placements) if not isinstance(p, Replicate))


def gather_rows(parts: list[DTensor]) -> list[torch.Tensor]:
    """The whole tensors of DTensors on one mesh, sharded by rows over one of its dimensions
    (``_sharded_by_rows_only``), with one all-gather of every rank's shards packed together.
    Shard(0) splits rows as ``torch.chunk`` does (chunks of ceil(rows / ranks), the last ones shorter or empty),
    so each shard is padded to its chunk size in the packed buffer and cut back after."""
    mesh, dim = parts[0].device_mesh, _row_mesh_dim(parts[0])
    group, ranks = mesh.get_group(dim), mesh.size(dim)
    chunks = [-(-p.shape[0] // ranks) for p in parts]
    row_numel = [math.prod(p.shape[1:]) for p in parts]
    sizes = [c * n for c, n in zip(chunks, row_numel)]
    total = sum(sizes)
    packed = torch.zeros(total, dtype=parts[0].dtype, device=parts[0].to_local().device)
    offset = 0
    for part, size in zip(parts, sizes):
        local = part.to_local().reshape(-1)
        packed[offset : offset + local.numel()].copy_(local)
        offset += size
    host = host_collectives_for(group)
    if host is not None:  # ranks on one host: through shared memory (read below, before the next collective)
        gathered = host.all_gather(packed)
    else:
        gathered = torch.empty(ranks * total, dtype=packed.dtype, device=packed.device)
        dist.all_gather_single(gathered, packed, group=group)
    wholes, offset = [], 0
    for part, chunk, size in zip(parts, chunks, sizes):
        rows = torch.cat(
            [
                gathered[r * total + offset : r * total + offset + size].view(chunk, *part.shape[1:])
                for r in range(ranks)
            ]
        )
        wholes.append(rows[: part.shape[0]])
        offset += size
    return wholes


def _generation_slices(
    model: nn.Module,
    named: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    gather_group: dist.ProcessGroup | None,
    report: SwitchReport,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    cast_whole: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    buckets: dict[int, list[tuple[str, DTensor]]] = {}  # FSDP2-only shards by mesh, to gather together
    filled: dict[int, int] = {}  # the whole bytes in each mesh's bucket
    for name, param in named:
        if isinstance(param, DTensor) and param.device_mesh.size() == 1:  # its one shard is the whole tensor
            param = param.to_local()  # a plain tensor: DTensor's dispatch was a third of the one-rank cast's time
        if not cast_whole and not isinstance(param, DTensor):  # the rollout casts it as it copies it in
            size = param.numel() * dtype.itemsize
            report.whole, report.held = report.whole + size, report.held + size
            yield name, param.detach()
            continue
        part = param.detach().to(dtype)
        if _sharded_by_rows_only(part) and part.device_mesh.size(_row_mesh_dim(part)) > 1:
            mesh, size = id(part.device_mesh), _nbytes(part)
            bucket = buckets.setdefault(mesh, [])
            if bucket and filled[mesh] + size > bucket_bytes:
                yield from _gathered_together(bucket, report)
                bucket.clear()
                filled[mesh] = 0
            bucket.append((name, part))
            filled[mesh] = filled.get(mesh, 0) + size
            continue
        if not isinstance(part, DTensor):  # an unsharded model: the tensor is already whole here
            report.whole += _nbytes(part)
            report.held += _nbytes(part)
            yield name, part
            continue
        own = _nbytes(part.to_local())
        whole_bytes = part.numel() * part.element_size()
        dim = tensor_parallel_dim(part)
        piece = unshard_data_parallel(part)
        if dim is None:
            report.whole += whole_bytes
        else:
            _check_split(model.config.model_type, name, dim)
            report.split += whole_bytes
            piece = gather_generation_shard(piece, dim, gather_group)
        report.received += _nbytes(piece) - own
        report.held += _nbytes(piece)
        yield name, piece
    for bucket in buckets.values():
        yield from _gathered_together(bucket, report)


def _gathered_together(bucket: list[tuple[str, DTensor]], report: SwitchReport) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole tensors of FSDP2-only shards (``DTensor.numel`` counts the whole), gathered in one collective."""
    for (name, part), whole in zip(bucket, gather_rows([part for _, part in bucket])):
        report.whole += _nbytes(whole)
        if (part.device_mesh.mesh_dim_names or ())[_row_mesh_dim(part)] == "ep":
            report.experts += _nbytes(whole)
        report.received += _nbytes(whole) - _nbytes(part.to_local())
        report.held += _nbytes(whole)
        yield name, whole


def _over_stages(
    model: PipelinedModel,
    named: Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]],
    dtype: torch.dtype,
    gather_group: dist.ProcessGroup | None,
    report: SwitchReport,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    stage_gather_group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's generation slices of its ``named`` tensors on every rank of the pp group: the rank holding a
    stage gathers them over its dp and gather groups as an unsplit model's, then sends them to its pp peers, which
    hold the same generation shard of their own stages. A tied head (the embedding's copy) is left out. With
    ``stage_gather_group`` (generation stages) a stage's decoder layers go to the ranks of its holder's group only."""

    def slices(stage: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = ((name, tensor) for name, tensor in named(stage) if name != model.tied_head_name)
        return _generation_slices(stage, tensors, dtype, gather_group, report, bucket_bytes)

    for name, tensor, arrived in model.stage_by_stage(slices, stage_gather_group):
        if arrived:
            size = _nbytes(tensor)
            report.received += size
            report.from_stages += size
            report.held += size
        yield name, tensor


def _buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, buffer in policy_buffers(model):
        yield name, buffer.full_tensor() if isinstance(buffer, DTensor) else buffer
