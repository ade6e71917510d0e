"""The actor's switch between training (FSDP2) and generation (a rollout engine) on the same devices."""

from __future__ import annotations

import time

import torch
from torch import nn

from hybridflow.batch_keys import METRICS
from hybridflow.engine.fsdp import full_parameters
from hybridflow.engine.memory import peak_memory_gb, reset_peak_memory
from hybridflow.hybrid_engine.offload import move_model, move_optimizer_state
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import Rollout, SamplingParams

OFFLOAD_DEVICE = torch.device("cpu")


class HybridEngine:
    """One actor in two modes. ``generate`` switches to generation, generates, and switches back.

    To generation: the rollout's weights are overwritten in place from the FSDP2 shards, one
    gathered parameter at a time, so the only other copy of the model is the rollout's own;
    then, when configured, the optimizer state (``optimizer_offload``) and the parameter shards
    with their gradients (``param_offload``) move to the CPU, leaving the devices to the KV cache.
    Back to training: the KV cache is freed and the offloaded state returns.

    Each call reports the switch times (``timing_s/weight_sync``, ``timing_s/offload``,
    ``timing_s/release_cache``, ``timing_s/reload``), the bytes offloaded and the peak memory of
    the generation (``perf/max_memory_gb_generation``, and ``perf/max_memory_gb``, which the
    actor's update raises to the step's peak: the counter is reset here, at the step's start).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rollout: Rollout,
        device: torch.device,
        *,
        param_offload: bool,
        optimizer_offload: bool,
    ):
        self.model = model
        self.optimizer = optimizer
        self.rollout = rollout
        self.device = device
        self.param_offload = param_offload
        self.optimizer_offload = optimizer_offload

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        """The rollout's output, with the switch metrics in ``meta_info[METRICS]``."""
        reset_peak_memory(self.device)
        clock = [time.perf_counter()]
        self.rollout.load_weights(full_parameters(self.model))
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
            "perf/offloaded_gb": offloaded / 2**30,
            "perf/max_memory_gb_generation": peak,
            "perf/max_memory_gb": peak,
        }
        return output

    def _offload(self) -> int:
        moved = 0
        if self.optimizer_offload:
            moved += move_optimizer_state(self.optimizer, OFFLOAD_DEVICE)
        if self.param_offload:
            moved += move_model(self.model, OFFLOAD_DEVICE)
        return moved

    def _reload(self) -> None:
        if self.param_offload:
            move_model(self.model, self.device)
        if self.optimizer_offload:
            move_optimizer_state(self.optimizer, self.device)
