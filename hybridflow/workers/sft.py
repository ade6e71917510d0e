"""The supervised fine-tuning role: a causal LM trained with FSDP2 (and tensor parallelism) on labelled tokens
(workers/supervised.py: the layout, the calls and the checkpoints every supervised role shares). A GRPO run starts
from the model directory ``hybridflow export`` writes from its checkpoint.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engine.sft import SFTEngine
from hybridflow.workers.supervised import SupervisedWorker


class SFTWorker(SupervisedWorker):
    """``evaluate``: each row's summed negative log-likelihood and trained-token count (engine/sft.py)."""

    def objective_engine(self, trained: Any, *, engine, optim, **objective: Any) -> SFTEngine:
        return SFTEngine(trained, engine, optim, dp_group=self.mesh["dp"].get_group())
