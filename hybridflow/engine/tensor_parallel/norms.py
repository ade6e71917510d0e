"""A norm over all of a projection's heads together (OLMoE's q/k norms: RMS over every head's features) when tensor
parallelism splits the heads: each rank holds its heads' part of the norm's weight, and the mean of squares must
still be over all the heads.

The family's own forward runs on DTensors: the input (this rank's heads' features) is read as sharded along its last
dimension and the weight as sharded with the heads, so DTensor's mean over that dimension sums the ranks' squares (and
its backward the reverse), and the output is this rank's features again. The model code stays free of parallelism.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class AllHeadNorm(ParallelStyle):
    """The style of a norm whose features are split with the heads (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _split_weights, _sharded_input, _local_output)


def _split_weights(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for parameter_name, parameter in list(module.named_parameters(recurse=False)):
        split = distribute_tensor(parameter.detach(), mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(parameter_name, nn.Parameter(split, requires_grad=parameter.requires_grad))


def _sharded_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    local = inputs[0]
    return (DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False), *inputs[1:])


def _local_output(module: nn.Module, output: DTensor, mesh: DeviceMesh):
    return output.to_local()
