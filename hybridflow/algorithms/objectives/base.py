"""What an objective is: the loss a role trains with (a supervised command's, or an RL role's), over the outputs of
the one packed forward.

An objective names the forward it needs (each answer token's log-prob, a sequence score, or a token value),
whether its rows come in pairs (chosen, rejected: kept on one rank and in one micro-batch) and whether it needs a
reference pass before the update. An engine runs the forward, micro-batching and optimizer steps (engine/update.py
``run_updates``: engine/supervised.py for the supervised objectives, engine/policy.py and critic.py for the RL
roles'); the objective gives a micro-batch's loss, and a supervised one the per-row measures of held-out rows and
the held-out metrics the driver forms from them. A micro-batch's loss is its share of the whole batch's loss over
every rank (``LossAggregation`` carries the batch's token and row counts), so any micro-batching gives the same
gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hybridflow.algorithms.aggregation import LossAggregation

TOKEN_LOG_PROBS = "token_log_probs"  # the forward: (B, R) each answer token's log-prob under the trained model
SEQUENCE_SCORES = "sequence_scores"  # the forward: (B,) a score head's output at each row's last token
TOKEN_VALUES = "token_values"  # the forward: (B, R) a value head's output at each response token

CAUSAL_LM = "causal_lm"  # the model: a causal language model
SEQUENCE_CLASSIFIER = "sequence_classifier"  # the model: a backbone with a scalar score head
TOKEN_CLASSIFIER = "token_classifier"  # the model: a backbone with a scalar head at every token (a critic)

Columns = Mapping[str, torch.Tensor]  # a batch's columns by name (batch_keys.py)


@dataclass(frozen=True)
class ForwardOutputs:
    """What the one forward gave for a batch of rows: the objective's ``output`` (the others are None), the
    entropy beside the log-probs where the objective reads it, and under an objective with a reference, the
    reference's token log-probs (held out: computed with them)."""

    log_probs: torch.Tensor | None = None  # (B, R) fp32, 0 on answer padding
    scores: torch.Tensor | None = None  # (B,) fp32
    values: torch.Tensor | None = None  # (B, R) fp32, 0 on answer padding
    entropy: torch.Tensor | None = None  # (B, R) fp32, 0 on answer padding
    reference_log_probs: torch.Tensor | None = None  # (B, R) fp32


class Objective:
    """A supervised objective. ``name``: the registry's name, the metrics' prefix and the passes' (``<name>_update``,
    ``<name>_eval``); ``settings``: the objective's config section (None where it has none)."""

    name: ClassVar[str]
    output: ClassVar[str] = TOKEN_LOG_PROBS
    model: ClassVar[str] = CAUSAL_LM
    paired: ClassVar[bool] = False  # rows 2k and 2k+1 are a (chosen, rejected) pair
    reference: ClassVar[bool] = False  # a reference pass before the update (``ref_log_prob`` in the batch)
    share_keys: ClassVar[tuple[str, ...]] = ()  # metrics that are shares of the batch's total: summed as they are
    shown: ClassVar[tuple[tuple[str, str], ...]] = ()  # (metric, label) pairs of the progress line

    def __init__(self, settings: Any = None):
        self.settings = settings

    def loss(
        self, outputs: ForwardOutputs, batch: Columns, agg: LossAggregation
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """A micro-batch's share of the batch's loss, and its metrics (token means, or shares: ``share_keys``)."""
        raise NotImplementedError

    def held_out_rows(self, outputs: ForwardOutputs, batch: Columns) -> dict[str, torch.Tensor]:
        """Each held-out row's measures (B,) each, on the worker: the driver gathers them for ``held_out_metrics``."""
        raise NotImplementedError

    def held_out_metrics(self, rows: Columns) -> dict[str, float]:
        """The held-out set's metrics (``val/...``) from every held-out row's measures, in the data set's order."""
        raise NotImplementedError
