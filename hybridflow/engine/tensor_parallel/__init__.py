"""Tensor parallelism for training: a model family's split applied with DTensor, composed with FSDP2.

The actor's training layout is a 2-D mesh (dp, tp): tensor parallelism inside each group of
``tp`` ranks (``parallelize_module`` with the family's plan), FSDP2 over the ``dp`` dimension.
Which modules of a decoder layer are split, column-wise or row-wise, is the table of
models/tensor_parallel.py (the native engine and the hybrid engine's switch read the same table);
here it becomes DTensor styles, and the model code stays free of parallelism. Embeddings, norms and
the LM head stay replicated within a tp group (sharded by FSDP2 over dp only): the decoder layers hold
almost all of the weights and compute. A mixture's experts split whole between the ranks (experts.py), its router
stays whole.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hybridflow.engine.fsdp import decoder_layers
from hybridflow.engine.lora import ADAPTER
from hybridflow.engine.tensor_parallel.experts import split_experts
from hybridflow.engine.tensor_parallel.norms import AllHeadNorm
from hybridflow.models.split_sizes import check_tensor_parallel_size
from hybridflow.models.tensor_parallel import LayerSplit, layer_split


def training_mesh(device: torch.device, dp: int, tp: int) -> DeviceMesh:
    """The (dp, tp) mesh over the process group's ranks: rank = dp_index * tp + tp_index."""
    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


def decoder_layer_plan(split: LayerSplit) -> dict[str, ParallelStyle]:
    """A decoder layer's DTensor plan: ColwiseParallel for the column-split modules (a bias is split
    along its output dimension with them), RowwiseParallel for the row-split ones. Hugging Face's
    attention reshapes with -1 heads, so it runs on the rank's local heads. A per-head norm (its input
    (batch, tokens, heads, head size)) keeps its weight whole, the input sharded along the heads: torch's
    SequenceParallel style, whose backward sums the weight's gradient over the ranks. A norm over all heads
    splits its weight with them (norms.py)."""
    head_norms = {name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in split.head_norms}
    return (
        {name: ColwiseParallel() for name in split.column}
        | {name: RowwiseParallel() for name in split.row}
        | head_norms
        | {name: AllHeadNorm() for name in split.all_head_norms}
    )


def lora_layer_plan(layer: nn.Module, split: LayerSplit) -> dict[str, ParallelStyle]:
    """``decoder_layer_plan`` for a layer whose linear modules may carry peft's LoRA adapters: an adapted
    module's own weight (``base_layer``) splits as the module would, and its adapters so that their product
    B A splits the same way: a column-split module's B by columns (its outputs; A sees the whole input, on
    every rank), a row-split module's A by rows (its inputs: the partial sums of x A^T are summed once, then
    the whole B applies on every rank)."""
    plan: dict[str, ParallelStyle] = {}
    for name, style in decoder_layer_plan(split).items():
        module = layer.get_submodule(name)
        if not hasattr(module, "base_layer"):  # not adapted
            plan[name] = style
            continue
        plan[f"{name}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            plan[f"{name}.lora_B.{ADAPTER}"] = ColwiseParallel()
        else:
            plan[f"{name}.lora_A.{ADAPTER}"] = RowwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard every decoder layer of ``model`` over ``tp_mesh`` with its family's plan (in place), a mixture's
    experts split between the ranks; a LoRA model's adapters split with the layers they wrap (``lora_layer_plan``)."""
    tp = tp_mesh.size()
    if tp == 1:  # nothing to split: any family
        return model
    split = layer_split(model.config.model_type)
    check_tensor_parallel_size(model.config, tp, "tensor_model_parallel_size")
    for layer in decoder_layers(model):
        frozen = {name for name, parameter in layer.named_parameters() if not parameter.requires_grad}
        parallelize_module(layer, tp_mesh, lora_layer_plan(layer, split))
        for name, parameter in layer.named_parameters():  # SequenceParallel's new parameters all require gradients
            parameter.requires_grad_(name not in frozen)
        if split.experts:
            split_experts(layer, tp_mesh)
    return model


def tensor_parallel_size(model: nn.Module) -> int:
    """How many ranks split the model's layers (the size of the "tp" mesh its parameters live on; 1: none)."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            return mesh.size(mesh.mesh_dim_names.index("tp"))
    return 1
