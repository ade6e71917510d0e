"""The hybrid engine: the actor trains (FSDP2) and generates (a rollout engine) on the same devices.

- switch.py   HybridEngine: weights to the generator in place, offload while generating, cache release
- offload.py  moving parameter shards, gradients and optimizer state between devices
"""

from hybridflow.hybrid_engine.offload import move_model, move_optimizer_state
from hybridflow.hybrid_engine.switch import HybridEngine

__all__ = ["HybridEngine", "move_model", "move_optimizer_state"]
