"""What the planner knows of a cluster: devices, their memory and speed, and the links between them.

GPU presets use published figures (dense bf16 tensor-core peak, HBM bandwidth, NVLink per direction,
one InfiniBand port per GPU) scaled by efficiencies typical of LLM training and decoding; the CPU
preset is this project's 2-core machine, one device per core, from docs/results.md's measurements,
or this machine's own once ``hybridflow plan --calibrate`` has measured it (planner/calibrate.py measures;
the coefficients are stored and read here).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    name: str
    nodes: int
    devices_per_node: int
    device_memory: float  # bytes per device the models may use
    flops: float  # peak bf16 matmul FLOP/s per device
    train_efficiency: float  # fraction of ``flops`` that training and scoring passes reach (MFU)
    decode_efficiency: float  # fraction of ``memory_bandwidth`` a decode step reaches
    memory_bandwidth: float  # bytes/s a device reads (weights and KV cache in a decode step)
    intra_node_bandwidth: float  # bytes/s per device in a collective inside a node
    inter_node_bandwidth: float  # bytes/s per device in a collective across nodes
    collective_latency: float  # seconds of fixed cost per collective call
    layer_overhead: float  # seconds of fixed cost per decoder layer per training/scoring forward (dispatch)
    decode_layer_overhead: float  # the same for the generation engine's prefill and decode calls

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int) -> ClusterSpec:
        return dataclasses.replace(self, nodes=nodes)

    def link_bandwidth(self, group_size: int) -> float:
        """Bandwidth of a collective among ``group_size`` devices (within a node when they fit in one)."""
        return self.intra_node_bandwidth if group_size <= self.devices_per_node else self.inter_node_bandwidth

    def allocation_unit(self) -> int:
        """Devices are given to colocated sets in whole nodes on a multi-node cluster, else one at a time."""
        return self.devices_per_node if self.nodes > 1 else 1


# A100 SXM 80 GB: 312 TFLOP/s bf16 dense, 2.0 TB/s HBM2e, NVLink 3 300 GB/s per direction, 200 Gb/s IB per GPU
A100_80G = ClusterSpec(
    name="a100-80g",
    nodes=1,
    devices_per_node=8,
    device_memory=76 * GB,
    flops=312e12,
    train_efficiency=0.40,
    decode_efficiency=0.60,
    memory_bandwidth=2.0e12,
    intra_node_bandwidth=300 * GB,
    inter_node_bandwidth=25 * GB,
    collective_latency=20e-6,
    layer_overhead=50e-6,
    decode_layer_overhead=20e-6,
)
PRESETS: dict[str, ClusterSpec] = {
    "a100-80g": A100_80G,
    # H100 SXM 80 GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 450 GB/s per direction, 400 Gb/s IB per GPU
    "h100-80g": dataclasses.replace(
        A100_80G,
        name="h100-80g",
        flops=989e12,
        memory_bandwidth=3.35e12,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
    ),
    # this project's machine: 2 cores (one rank each), 24 GiB shared; bf16 matmul ~0.4 TFLOP/s per core
    # (engine/flops.py's measured peak), a gloo all-reduce between 2 processes ~1.1 ms (bench/gloo_allreduce.py)
    "cpu": dataclasses.replace(
        A100_80G,
        name="cpu",
        devices_per_node=2,
        device_memory=10 * GB,
        flops=0.4e12,
        train_efficiency=0.10,
        decode_efficiency=0.30,
        memory_bandwidth=10 * GB,
        intra_node_bandwidth=1 * GB,
        inter_node_bandwidth=1 * GB,
        collective_latency=1.1e-3,
    ),
}


def cluster_preset(name: str, nodes: int = 1) -> ClusterSpec:
    """A preset on ``nodes`` nodes; ``cpu`` with this machine's coefficients once ``hybridflow plan
    --calibrate`` has measured them (planner/calibrate.py)."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; presets: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    if name == "cpu":
        preset = load_calibration(preset) or preset
    return preset.with_nodes(nodes)


def calibration_file() -> Path:
    """Where ``hybridflow plan --calibrate`` stores this machine's coefficients."""
    from hybridflow.models import cache_root

    return cache_root() / "planner" / "cpu.json"


CALIBRATED_FIELDS = (
    "flops", "train_efficiency", "decode_efficiency", "memory_bandwidth", "intra_node_bandwidth",
    "inter_node_bandwidth", "collective_latency", "layer_overhead", "decode_layer_overhead",
)  # fmt: skip


def save_calibration(cluster: ClusterSpec, path: Path | None = None) -> Path:
    """Store ``cluster``'s measured coefficients (CALIBRATED_FIELDS), with when and under what load."""
    path = path or calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    values = {name: getattr(cluster, name) for name in CALIBRATED_FIELDS}
    path.write_text(
        json.dumps(values | {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg()[0]}, indent=1)
    )
    return path


def load_calibration(base: ClusterSpec, path: Path | None = None) -> ClusterSpec | None:
    """``base`` with the stored coefficients, or None when this machine was never calibrated."""
    path = path or calibration_file()
    if not path.is_file():
        return None
    values = json.loads(path.read_text())
    return dataclasses.replace(base, **{name: float(values[name]) for name in CALIBRATED_FIELDS})
