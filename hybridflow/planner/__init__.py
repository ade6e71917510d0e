"""Auto-mapping (the HybridFlow paper's §6): choose the placement of a run's models and their layouts.

- cluster.py   ClusterSpec: devices, memory, throughput, links; presets (a100-80g, h100-80g, cpu)
- workload.py  ModelShape and Workload: what a step asks of each model (from a config, or paper sizes)
- cost.py      seconds per stage and memory per device of one model in one layout (a LayoutShape,
               hybrid_engine/layout_shape.py: the layout the hybrid actor runs)
- search.py    Algorithm 1: colocated sets, device counts, per-model best layouts, step cost
"""

from hybridflow.planner.cluster import PRESETS, ClusterSpec, cluster_preset
from hybridflow.planner.search import Plan, plan_run
from hybridflow.planner.workload import PAPER_MODELS, ModelShape, Workload, workload_from_config

__all__ = [
    "PAPER_MODELS",
    "PRESETS",
    "ClusterSpec",
    "ModelShape",
    "Plan",
    "Workload",
    "cluster_preset",
    "plan_run",
    "workload_from_config",
]
