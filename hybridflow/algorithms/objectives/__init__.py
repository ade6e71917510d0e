"""The training objectives by name (base.py: what an objective is): the supervised commands' (``sft``, ``dpo``,
``rm``), the RL roles' (``policy``: the actor's, ``value``: the critic's) and the training service's losses
(``cross_entropy``, ``importance_sampling``, ``ppo``: datum.py). A new objective is a file with an ``Objective``
subclass and one line in ``OBJECTIVES`` below (or ``OBJECTIVES.add`` from a user's code)."""

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
from hybridflow.algorithms.objectives.datum import ClippedRatio, CrossEntropy, DatumObjective, ImportanceSampling
from hybridflow.algorithms.objectives.direct_preference import DirectPreference
from hybridflow.algorithms.objectives.nll import NegativeLogLikelihood
from hybridflow.algorithms.objectives.policy_gradient import PolicyGradient
from hybridflow.algorithms.registry import Registry

OBJECTIVES: Registry[type[Objective]] = Registry("objective", "the command's or the role's objective")
for _objective in (NegativeLogLikelihood, DirectPreference, BradleyTerry, PolicyGradient, ClippedValue):
    OBJECTIVES.add(_objective.name, _objective)
for _objective in (CrossEntropy, ImportanceSampling, ClippedRatio):
    OBJECTIVES.add(_objective.name, _objective)


def datum_objectives() -> list[str]:
    """The names of the objectives the training service serves (``DatumObjective``s), sorted."""
    return [name for name in OBJECTIVES.names() if issubclass(OBJECTIVES.get(name), DatumObjective)]


def datum_objective(name: str) -> type[DatumObjective]:
    """The service's loss ``name`` (its ``loss_fn``); ValueError naming those it has otherwise."""
    if name not in datum_objectives():
        raise ValueError(f"loss_fn {name!r} is not served here (this service has {datum_objectives()})")
    return OBJECTIVES.get(name)


__all__ = [
    "CAUSAL_LM",
    "OBJECTIVES",
    "DatumObjective",
    "datum_objective",
    "datum_objectives",
    "SEQUENCE_CLASSIFIER",
    "SEQUENCE_SCORES",
    "TOKEN_CLASSIFIER",
    "TOKEN_LOG_PROBS",
    "TOKEN_VALUES",
    "ForwardOutputs",
    "Objective",
]
