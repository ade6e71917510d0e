"""The training objectives by name (base.py: what an objective is): the supervised commands' (``sft``, ``dpo``,
``rm``) and the RL roles' (``policy``: the actor's, ``value``: the critic's). A new objective is a file with an
``Objective`` subclass and one line in ``OBJECTIVES`` below (or ``OBJECTIVES.add`` from a user's code)."""

from hybridflow.algorithms.objectives.base import (
    CAUSAL_LM,
    SEQUENCE_CLASSIFIER,
    SEQUENCE_SCORES,
    TOKEN_CLASSIFIER,
    TOKEN_LOG_PROBS,
    TOKEN_VALUES,
    ForwardOutputs,
    Objective,
)
from hybridflow.algorithms.objectives.bradley_terry import BradleyTerry
from hybridflow.algorithms.objectives.clipped_value import ClippedValue
from hybridflow.algorithms.objectives.direct_preference import DirectPreference
from hybridflow.algorithms.objectives.nll import NegativeLogLikelihood
from hybridflow.algorithms.objectives.policy_gradient import PolicyGradient
from hybridflow.algorithms.registry import Registry

OBJECTIVES: Registry[type[Objective]] = Registry("objective", "the command's or the role's objective")
for _objective in (NegativeLogLikelihood, DirectPreference, BradleyTerry, PolicyGradient, ClippedValue):
    OBJECTIVES.add(_objective.name, _objective)

__all__ = [
    "CAUSAL_LM",
    "OBJECTIVES",
    "SEQUENCE_CLASSIFIER",
    "SEQUENCE_SCORES",
    "TOKEN_CLASSIFIER",
    "TOKEN_LOG_PROBS",
    "TOKEN_VALUES",
    "ForwardOutputs",
    "Objective",
]
