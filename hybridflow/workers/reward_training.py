"""The reward-model training role: a sequence classifier trained with the Bradley-Terry loss on preference pairs,
two rows per pair (workers/supervised.py: the layout, the calls and the checkpoints every supervised role shares).

The model is the starting model's backbone with a scalar head (models/loading.py ``load_reward_model``: zero where
the directory has none); ``hybridflow export`` writes a model directory from its checkpoint that an RL run's
``reward_model.model.path`` loads.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engine.reward_training import RewardTrainingEngine
from hybridflow.models import load_reward_model
from hybridflow.workers.supervised import SupervisedWorker


class RewardTrainingWorker(SupervisedWorker):
    """``evaluate``: ``sequence_score`` (B,), each row's score (engine/reward_training.py)."""

    load_model = staticmethod(load_reward_model)

    def objective_engine(self, trained: Any, *, engine, optim, **objective: Any) -> RewardTrainingEngine:
        pad = trained.model.config.get_text_config().pad_token_id  # load_reward_model sets it: the rule's pad
        return RewardTrainingEngine(trained, engine, optim, pad_token_id=pad, dp_group=self.mesh["dp"].get_group())
