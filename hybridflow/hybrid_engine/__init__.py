"""The hybrid engine: the actor trains (FSDP2) and generates (a rollout engine) on the same devices.

- switch.py   HybridEngine: weights to the generator in place, offload while generating, cache release
- offload.py  moving parameter shards, gradients and optimizer state between devices
- transfer_plan.py  asynchronous modes: which actor rank sends which pieces to which rollout rank (pure)
- pool_transfer.py  the transfer group spanning the actor's pool and the rollout's; send_weights / receive_weights
- transfer_setup.py  what both pools agree on to make the same plan
"""

from hybridflow.hybrid_engine.offload import move_model, move_optimizer_state
from hybridflow.hybrid_engine.switch import HybridEngine

__all__ = ["HybridEngine", "move_model", "move_optimizer_state"]
