"""FSDP2's gathered weights on a group of one rank, in one pass.

Nothing moves between ranks there, yet before a unit's forward FSDP2 (torch 2.13) casts each fp32 shard to the compute
dtype as a tensor of its own and then copies that into the unit's gathered weight: two passes over every weight and a
fresh bf16 copy of the model each update. ``one_pass_unshard`` writes the gathered weight with one ``copy_`` from the
shard, which casts as it copies: the same round-to-nearest conversion, the same bits (SmolLM2-135M's update on the
Zen 4 host: 36-39 ms -> 25-27 ms, docs/log/training.md §51). The reduce-scatter's copy on one rank:
engine/host_collectives.py ``OneRankReduceScatter``.

It reaches into FSDP2's internals (its parameter groups and their states), which the pinned torch fixes; a group whose
parameters take another path (a tensor subclass with its own gather, CPU offload, weights resharded after forward to
a smaller group) keeps FSDP2's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState, alloc_storage
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


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


def gather_in_one_pass(unit: FSDPModule) -> None:
    """Give the parameter groups of ``unit`` (an FSDP2 unit on one rank) the one-pass gather above."""
    for group in unit._get_fsdp_state()._fsdp_param_groups:
        group.wait_for_unshard = one_pass_unshard(group)
