"""The actor's switch between training (FSDP2, optionally tensor-parallel) and generation (a rollout
engine, optionally tensor-parallel in groups of tg) on the same devices."""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field

import torch
from torch.distributed.tensor import DTensor

from hybridflow.batch_keys import METRICS
from hybridflow.engine.lora import lora_scaling
from hybridflow.engine.memory import peak_memory_gb, reset_peak_memory
from hybridflow.engine.optim import TrainedModel
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.offload import move_model, move_optimizer_state
from hybridflow.hybrid_engine.reshard import (
    SwitchReport,
    adapter_generation_weights,
    base_generation_weights,
    generation_weights,
)
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import Rollout, SamplingParams

OFFLOAD_DEVICE = torch.device("cpu")
ONE_PROCESS = LayoutShape(dp=1, t=1, tg=1)


@dataclass(eq=False)
class HybridEngine:
    """One actor in two modes. ``generate`` switches to generation, generates, and switches back.

    To generation: the rollout's weights are overwritten in place with this rank's generation slice
    (reshard.py: gathered from the training shards one parameter at a time, only the missing pieces,
    inside the rank's gather group), so the only other copy is the rollout's own 1/tg of the
    weights (a LoRA model's adapters only, after the first switch: ``_sync``); then, when configured, the
    optimizer state (``optimizer_offload``) and the parameter shards with their gradients
    (``param_offload``) move to the CPU, leaving the devices to the KV cache.
    Back to training: the KV cache is freed and the offloaded state returns.

    Each call reports what the switch moved: ``switch/received_mb`` (bytes this rank received),
    ``switch/predicted_mb`` (the paper's formula for them), ``switch/generation_weights_mb`` (the
    generation weights the rank gave the rollout: all of them, or a LoRA model's adapters) and
    ``switch/training_params_mb`` (its training shards); the
    switch times (``timing_s/weight_sync``, ``timing_s/offload``,
    ``timing_s/release_cache``, ``timing_s/reload``), the bytes offloaded and the peak memory of
    the generation (``perf/max_memory_gb_generation``, and ``perf/max_memory_gb``, which the
    actor's update raises to the step's peak: the counter is reset here, at the step's start).
    """

    trained: TrainedModel  # the actor's training state, shared with its PolicyEngine
    rollout: Rollout
    device: torch.device
    _: KW_ONLY
    param_offload: bool
    optimizer_offload: bool
    dtype: torch.dtype  # of the generation weights (what travels)
    # the actor's layouts (hybrid_engine/layout.py); the defaults: a model on one process
    shape: LayoutShape = ONE_PROCESS
    gather_group: torch.distributed.ProcessGroup | None = None
    # generation stages (pg > 1): the pp ranks whose training stages make this rank's generation stage
    stage_gather_group: torch.distributed.ProcessGroup | None = None
    base_synced: bool = field(default=False, init=False)  # a LoRA model's frozen base is in the rollout (sent once)

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        """The rollout's output, with the switch metrics in ``meta_info[METRICS]``."""
        reset_peak_memory(self.device)
        clock = [time.perf_counter()]
        report = SwitchReport()
        self._sync(report)
        clock.append(time.perf_counter())
        offloaded = self._offload()
        clock.append(time.perf_counter())
        try:
            output = self.rollout.generate_sequences(prompts, sampling)
        finally:
            clock.append(time.perf_counter())
            self.rollout.release_cache()
            clock.append(time.perf_counter())
            self._reload()
            clock.append(time.perf_counter())
        peak = peak_memory_gb(self.device)
        output.meta_info[METRICS] = {
            "timing_s/weight_sync": clock[1] - clock[0],
            "timing_s/offload": clock[2] - clock[1],
            "timing_s/release_cache": clock[4] - clock[3],
            "timing_s/reload": clock[5] - clock[4],
            "switch/received_mb": report.received / 2**20,
            "switch/predicted_mb": report.predicted(self.shape) / 2**20,
            "switch/generation_weights_mb": report.held / 2**20,
            "switch/training_params_mb": self._training_bytes() / 2**20,
            "perf/offloaded_gb": offloaded / 2**30,
            "perf/max_memory_gb_generation": peak,
            "perf/max_memory_gb": peak,
        }
        return output

    def _sync(self, report: SwitchReport) -> None:
        """The rollout takes the policy of now: all its weights; for a LoRA model, its base the first time and
        its adapters every time (what an update changes), so every switch after the first moves adapters only."""
        model, groups = self.trained.model, (self.dtype, self.gather_group, report)
        stages = self.stage_gather_group
        scaling = lora_scaling(model)
        if scaling is None:
            cast = not self.rollout.load_casts
            self.rollout.load_weights(generation_weights(model, *groups, stage_gather_group=stages, cast_whole=cast))
            return
        if not self.base_synced:
            self.rollout.load_base_weights(base_generation_weights(model, *groups, stage_gather_group=stages))
            self.base_synced = True
        self.rollout.load_adapters(adapter_generation_weights(model, *groups, stage_gather_group=stages), scaling)

    def _training_bytes(self) -> int:
        """This rank's shards of the training parameters (fp32 masters)."""
        local = (p.to_local() if isinstance(p, DTensor) else p for p in self.trained.model.parameters())
        return sum(t.numel() * t.element_size() for t in local)

    def _offload(self) -> int:
        moved = 0
        if self.optimizer_offload:
            moved += move_optimizer_state(self.trained.optimizer, OFFLOAD_DEVICE)
        if self.param_offload:
            moved += move_model(self.trained.model, OFFLOAD_DEVICE)
        return moved

    def _reload(self) -> None:
        if self.param_offload:
            move_model(self.trained.model, self.device)
        if self.optimizer_offload:
            move_optimizer_state(self.trained.optimizer, self.device)
