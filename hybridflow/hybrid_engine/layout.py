"""The actor's two layouts over its dp * t ranks, as device meshes: training (dp, t) and generation.

Training: rank = dp_index * t + tp_index (engine/tensor_parallel.training_mesh). Generation (§5.3 of
the HybridFlow paper, regroup.py): inside each training TP group, the t / tg generation groups are
strided (t=4, tg=2: {0, 2} and {1, 3}) and the gather groups consecutive ({0, 1} and {2, 3}). The
rank tables are ``LayoutShape``'s (layout_shape.py): the generation mesh's first dimension is the
generation data-parallel index (prompts are split over it) and its second the generation
tensor-parallel index (the shard a rank holds); with generation stages (pg > 1) it is (dp, pp, tp), the middle
the generation stage a rank runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.engine.pipeline import pipeline_mesh
from hybridflow.engine.tensor_parallel import training_mesh
from hybridflow.hybrid_engine.layout_shape import LayoutShape


@dataclass
class ActorLayouts:
    """This rank's meshes and groups in both layouts."""

    shape: LayoutShape
    training: DeviceMesh  # (dp x sp, tp), or with pipeline stages (dp x sp, pp, tp)
    generation: DeviceMesh  # (dp, tp), or with generation stages (dp, pp, tp)
    gather_group: dist.ProcessGroup | None  # the ranks whose training shards make this rank's generation shard
    # with generation stages (pg > 1): the pp ranks whose training stages make this rank's generation stage
    stage_gather_group: dist.ProcessGroup | None = None

    @classmethod
    def build(cls, device: torch.device, shape: LayoutShape) -> ActorLayouts:
        """Every rank of the default process group calls this with the same shape (it creates groups)."""
        if shape.world != dist.get_world_size():
            raise ValueError(f"a layout of {shape.world} ranks over {dist.get_world_size()} processes")
        device_type = device.type
        if shape.pp > 1:  # the same table as shape.pipeline_ranks()
            training = pipeline_mesh(device, shape.fsdp, shape.pp, shape.t)
        else:  # the same table as shape.training_ranks()
            training = training_mesh(device, shape.fsdp, shape.t)
        names = ("dp", "pp", "tp") if shape.pg > 1 else ("dp", "tp")
        generation = DeviceMesh(device_type, shape.generation_ranks(), mesh_dim_names=names)
        gather = DeviceMesh(device_type, shape.gather_ranks(), mesh_dim_names=("shard", "gather"))
        gather_group = gather["gather"].get_group() if shape.micro_dp > 1 else None
        stage_gather_group = None
        if shape.pg > 1:
            stages = DeviceMesh(device_type, shape.stage_gather_ranks(), mesh_dim_names=("stage", "stage_gather"))
            stage_gather_group = stages["stage_gather"].get_group()
        return cls(shape, training, generation, gather_group, stage_gather_group)

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The pp ranks holding one model's stages (None: no pipeline stages)."""
        return self.training["pp"].get_group() if self.shape.pp > 1 else None

    @property
    def generation_group(self) -> dist.ProcessGroup | None:
        """The tg ranks that generate together (None: each rank generates alone)."""
        return self.generation["tp"].get_group() if self.shape.tg > 1 else None

    @property
    def generation_stage_group(self) -> dist.ProcessGroup | None:
        """The pg ranks whose generation stages make one model (None: every rank generates with every layer)."""
        return self.generation["pp"].get_group() if self.shape.pg > 1 else None
