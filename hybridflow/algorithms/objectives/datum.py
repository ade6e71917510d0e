"""The training service's losses (the Tinker API's ``loss_fn``: cross_entropy, importance_sampling, ppo) as
objectives, over the pure per-token functions of datum_losses.py.

Their rows are datums (engine/datum_pass.py lays them out as the RL step's rows: a one-token prompt, the datum's
tokens as the "response", each position's target token as its label); their per-token inputs come with each datum;
their settings are the call's ``loss_fn_config`` (the loss's defaults, checked here). The loss is a *sum* over every
token of every datum, not a mean (the API's contract: the client normalises through its weights or advantages), so
``LossAggregation`` is not read. The service returns every position's loss (``per_token``); the client evaluates
held-out data through its own forward calls, so there is no held-out pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from hybridflow.algorithms.aggregation import LossAggregation
from hybridflow.algorithms.datum_losses import (
    ADVANTAGES,
    PPO_CLIP_HIGH,
    PPO_CLIP_LOW,
    SAMPLER_LOGPROBS,
    WEIGHTS,
    DatumLossFn,
    cross_entropy,
    importance_sampling,
    ppo,
)
from hybridflow.algorithms.objectives.base import Columns, ForwardOutputs, Objective
from hybridflow.batch_keys import RESPONSE_MASK


class DatumObjective(Objective):
    """A loss of the training service. ``fn``: its per-token loss; ``inputs``: the per-token inputs it reads besides
    ``target_tokens``; ``trains``: the input whose zeros make a token's loss gradient exactly zero (a weight or an
    advantage), so the pass differentiates only the others; ``defaults``: its settings and their values."""

    fn: ClassVar[DatumLossFn]
    inputs: ClassVar[tuple[str, ...]]
    trains: ClassVar[str]
    defaults: ClassVar[Mapping[str, float]] = {}

    def __init__(self, settings: Mapping[str, float] | None = None):
        super().__init__(self.checked(settings))

    @classmethod
    def checked(cls, given: Mapping[str, float] | None) -> dict[str, float]:
        """The loss's settings: its defaults updated by ``given``; ValueError naming a setting it does not have."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(cls.defaults))
        if unknown:
            known = sorted(cls.defaults) or "none"
            raise ValueError(f"loss_fn_config {unknown} is not a setting of {cls.name} (its settings: {known})")
        return {**cls.defaults, **{key: float(value) for key, value in given.items()}}

    def per_token(self, outputs: ForwardOutputs, batch: Columns) -> torch.Tensor:
        """Each position's loss (B, R), zero on padding."""
        inputs = {name: batch[name] for name in self.inputs}
        return type(self).fn(outputs.log_probs, inputs, batch[RESPONSE_MASK].float(), self.settings)

    def loss(self, outputs: ForwardOutputs, batch: Columns, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        return self.per_token(outputs, batch).sum(), {}


class CrossEntropy(DatumObjective):
    name = "cross_entropy"
    fn = staticmethod(cross_entropy)
    inputs = (WEIGHTS,)
    trains = WEIGHTS


class ImportanceSampling(DatumObjective):
    name = "importance_sampling"
    fn = staticmethod(importance_sampling)
    inputs = (SAMPLER_LOGPROBS, ADVANTAGES)
    trains = ADVANTAGES


class ClippedRatio(DatumObjective):
    name = "ppo"
    fn = staticmethod(ppo)
    inputs = (SAMPLER_LOGPROBS, ADVANTAGES)
    trains = ADVANTAGES
    defaults = {PPO_CLIP_LOW: 0.8, PPO_CLIP_HIGH: 1.2}  # on the ratio: 1 - 0.2 and 1 + 0.2

    @classmethod
    def checked(cls, given: Mapping[str, float] | None) -> dict[str, float]:
        """Also a ValueError for thresholds that are not low <= 1 <= high."""
        settings = super().checked(given)
        if not settings[PPO_CLIP_LOW] <= 1.0 <= settings[PPO_CLIP_HIGH]:
            raise ValueError(
                f"ppo needs {PPO_CLIP_LOW} <= 1 <= {PPO_CLIP_HIGH} (bounds on the ratio, e.g. 0.8 and 1.2), "
                f"got {settings[PPO_CLIP_LOW]} and {settings[PPO_CLIP_HIGH]}"
            )
        return settings
