"""Tensor parallelism for training: a plan per model family, applied with DTensor, composed with FSDP2.

The actor's training layout is a 2-D mesh (dp, tp): tensor parallelism inside each group of
``tp`` ranks (``parallelize_module`` with the family's plan), FSDP2 over the ``dp`` dimension.
The plans live in one small file per family (llama.py, qwen2.py, mistral.py); the model code stays
free of parallelism. Embeddings, norms and the LM head stay replicated within a tp group (sharded
by FSDP2 over dp only): the decoder layers hold almost all of the weights and compute. Pipeline
parallelism is out of scope.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from hybridflow.engine.fsdp import decoder_layers
from hybridflow.engine.tensor_parallel import llama, mistral, qwen2
from hybridflow.models.split_sizes import check_tensor_parallel_size

TP_PLANS: dict[str, Callable[[], dict[str, ParallelStyle]]] = {
    "llama": llama.decoder_layer_plan,
    "qwen2": qwen2.decoder_layer_plan,
    "mistral": mistral.decoder_layer_plan,
}


def training_mesh(device: torch.device, dp: int, tp: int) -> DeviceMesh:
    """The (dp, tp) mesh over the process group's ranks: rank = dp_index * tp + tp_index."""
    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard every decoder layer of ``model`` over ``tp_mesh`` with its family's plan (in place)."""
    model_type = model.config.model_type
    if model_type not in TP_PLANS:
        raise ValueError(f"no tensor-parallel plan for model type '{model_type}'; plans: {', '.join(TP_PLANS)}")
    tp = tp_mesh.size()
    check_tensor_parallel_size(model.config, tp, "tensor_model_parallel_size")
    if tp == 1:
        return model
    plan = TP_PLANS[model_type]()
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, plan)
    return model


def tensor_parallel_size(model: nn.Module) -> int:
    """How many ranks split the model's layers (the size of the "tp" mesh its parameters live on; 1: none)."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            return mesh.size(mesh.mesh_dim_names.index("tp"))
    return 1
