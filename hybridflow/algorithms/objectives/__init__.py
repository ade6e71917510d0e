"""The supervised objectives by name (base.py: what an objective is). A new objective is a file with an
``Objective`` subclass and one line in ``OBJECTIVES`` below (or ``OBJECTIVES.add`` from a user's code)."""

from hybridflow.algorithms.objectives.base import (
    CAUSAL_LM,
    SEQUENCE_CLASSIFIER,
    SEQUENCE_SCORES,
    TOKEN_LOG_PROBS,
    ForwardOutputs,
    Objective,
)
from hybridflow.algorithms.objectives.bradley_terry import BradleyTerry
from hybridflow.algorithms.objectives.direct_preference import DirectPreference
from hybridflow.algorithms.objectives.nll import NegativeLogLikelihood
from hybridflow.algorithms.registry import Registry

OBJECTIVES: Registry[type[Objective]] = Registry("objective", "the command's objective")
for _objective in (NegativeLogLikelihood, DirectPreference, BradleyTerry):
    OBJECTIVES.add(_objective.name, _objective)

__all__ = [
    "CAUSAL_LM",
    "OBJECTIVES",
    "SEQUENCE_CLASSIFIER",
    "SEQUENCE_SCORES",
    "TOKEN_LOG_PROBS",
    "ForwardOutputs",
    "Objective",
]
