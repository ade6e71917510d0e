"""FSDP2 on a group of one rank without its copies: nothing moves between ranks, so what FSDP2 still does to the
bytes is overhead.

- Weights: before a unit's forward, FSDP2 (torch 2.13) casts each fp32 shard to the compute dtype as a new tensor and
  copies that into the unit's gathered weight: two passes over every weight and a fresh bf16 copy of the model each
  update (SmolLM2-135M on the Zen 4 host: 58 ms of casts and 39 ms of copies an update, docs/log/training.md §51).
  ``one_pass_unshard`` makes it one ``copy_`` from the fp32 shard into the gathered weight, which casts as it copies:
  the same round-to-nearest conversion, the same bits.
- Gradients: FSDP2 skips the reduce-scatter but copies its input buffer (the gradients, cast to the reduce dtype)
  into a second one of the same size; ``OneRankReduceScatter`` hands out the input as the output, so that copy is a
  ``copy_`` of a tensor onto itself, which torch skips.

Both reach into FSDP2's internals (its parameter groups and their states), which the pinned torch fixes; a unit
whose parameters take another path (a tensor subclass with its own gather, CPU offload, weights resharded after
forward to a smaller group) keeps FSDP2's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState, alloc_storage
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


class OneRankReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter on a group of one rank, which FSDP2 never calls: ``allocate`` hands out the input
    (``pending``) again as the output FSDP2 asks for next, so FSDP2's copy of one into the other changes nothing."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        pending, self.pending = self.pending, None
        if pending is not None and pending.shape == torch.Size(size) and pending.dtype == dtype:
            return pending
        self.pending = torch.empty(*size, dtype=dtype, device=device)
        return self.pending

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.pending = None
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _casts_in_one_pass(param: FSDPParam) -> bool:
    """Whether FSDP2's one-rank gather of ``param`` is a cast of its flat shard and a copy (the case
    ``one_pass_unshard`` takes over)."""
    return (
        param.param_dtype is not None
        and not param.offload_to_cpu
        and param.sharded_state == ShardedState.SHARDED
        and not hasattr(param._sharded_local_tensor, "fsdp_pre_all_gather")
    )


def one_pass_unshard(group: FSDPParamGroup) -> Callable[[], None]:
    """``group.wait_for_unshard`` for a group on one rank: each gathered weight is written by one ``copy_`` from the
    fp32 shard (cast on the way), then FSDP2's own steps after its copy; anything else goes to FSDP2's method."""
    fsdp_own = group.wait_for_unshard

    def wait_for_unshard() -> None:
        result = group._all_gather_result
        if (
            result is None
            or result.all_gather_work is not None
            or not isinstance(group.mesh_info, FSDPMeshInfo)
            or group._all_gather_process_group.size() != 1
            or group.comm_ctx.all_gather_state is not None
            or not all(_casts_in_one_pass(param) for param in group.fsdp_params)
        ):
            fsdp_own()
            return
        for param in group.fsdp_params:
            shard = param._sharded_param_data  # flat, the shard's dtype
            param.init_all_gather_outputs([shard.numel()], [param.param_dtype], 1, group.device)
            gathered = param.all_gather_outputs[0]
            alloc_storage(gathered)
            with torch.autograd._unsafe_preserve_version_counter(gathered):
                gathered.copy_(shard)
        for param in group.fsdp_params:
            param.init_unsharded_param()
        group._to_unsharded()
        copied = group.device_handle.Event()
        copied.record()
        group._wait_all_gather_streams_on_event(copied)
        group._all_gather_result = None

    return wait_for_unshard


def skip_one_rank_copies(units: Sequence[FSDPModule]) -> None:
    """Give the FSDP2 units of a one-rank group the gather and reduce above (the same values, fewer passes)."""
    reduce = OneRankReduceScatter()
    for unit in units:
        unit.set_custom_reduce_scatter(reduce)
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            group.wait_for_unshard = one_pass_unshard(group)
