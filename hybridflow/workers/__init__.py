"""Role classes that worker groups run; one role per class."""

from hybridflow.workers.actor_rollout import ActorRolloutWorker, ActorWorker
from hybridflow.workers.config import ActorRolloutRefConfig, RewardModelConfig, TeacherConfig
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reference import RefPolicyWorker
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.rollout import RolloutWorker
from hybridflow.workers.teacher import TeacherWorker

__all__ = [
    "ActorRolloutRefConfig",
    "ActorRolloutWorker",
    "ActorWorker",
    "CriticWorker",
    "RefPolicyWorker",
    "RewardModelConfig",
    "RewardModelWorker",
    "RolloutWorker",
    "TeacherConfig",
    "TeacherWorker",
]
