"""Partial rollout: samples a weight push cut short, continued under the new weights.

When the trainer pushes new weights while the rollout's chunk is generating, the driver stops the call at its
next decode step (hybrid_engine/interrupt.py). Finished samples keep their tokens; a group with a sample cut
short stays open, and the rollouter's next call continues those samples: their prompt and the tokens they
have are prefilled under the new weights (the KV of the prefix is recomputed) and generation goes on to the
response's budget. Every response token records the version that generated it (``token_versions``), and the
behaviour log-probs stay per token, so the decoupled objective weighs each token by the policy that chose it.
A group's version, for the staleness bound, is that of its oldest token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridflow.batch_keys import INTERRUPTED, RESPONSE_MASK, TOKEN_VERSIONS
from hybridflow.protocol import DataProto
from hybridflow.trainer.services.timeline import StepTimeline


@dataclass(frozen=True)
class PartialRollout:
    """What the rollouter needs from the trainer to cut calls short and continue them."""

    interrupt: Callable[[int], None]  # stop generation call n where it is
    # the cut rows (prompt + response so far) -> the same rows generated to the end (or cut again), metrics, spans
    continue_rows: Callable[[DataProto, int], tuple[DataProto, dict[str, float], StepTimeline]]


@dataclass
class OpenGroup:
    """A group with a sample a weight push cut short: its samples done, and those to continue."""

    prompt: DataProto
    chunk: int  # the call it began in (whose metrics it shares)
    done: dict[int, DataProto] = field(default_factory=dict)  # sample index -> its finished row
    cut: dict[int, DataProto] = field(default_factory=dict)  # sample index -> its row so far

    def take(self, sample: int, row: DataProto) -> None:
        """A generation call's row for ``sample``: done, or cut short (again)."""
        if bool(row.batch[INTERRUPTED][0]):
            self.cut[sample] = row
        else:
            self.cut.pop(sample, None)
            self.done[sample] = row

    @property
    def complete(self) -> bool:
        return not self.cut

    def rows(self) -> DataProto:
        """The group's rows, in sample order (once complete)."""
        return DataProto.concat([self.done[s] for s in sorted(self.done)])


def version_range(rows: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's oldest and newest token version, over its response: (B,), (B,)."""
    versions, mask = rows.batch[TOKEN_VERSIONS], rows.batch[RESPONSE_MASK].bool()
    oldest = versions.masked_fill(~mask, torch.iinfo(versions.dtype).max).amin(dim=1)
    newest = versions.masked_fill(~mask, torch.iinfo(versions.dtype).min).amax(dim=1)
    empty = ~mask.any(dim=1)  # no response token: the row's versions as they are
    return torch.where(empty, versions.amin(dim=1), oldest), torch.where(empty, versions.amax(dim=1), newest)


def oldest_version(rows: DataProto) -> int:
    """The version of the oldest token the rows' responses hold."""
    return int(version_range(rows)[0].min())


def continued_versions(cut: DataProto, version: int) -> torch.Tensor:
    """Token versions of rows continued under ``version``: the prefix keeps its own, the rest is ``version``."""
    versions = cut.batch[TOKEN_VERSIONS]
    prefix = cut.batch[RESPONSE_MASK].sum(dim=1)  # a cut row's mask covers the tokens it has
    positions = torch.arange(versions.shape[1])[None, :]
    return torch.where(positions < prefix[:, None], versions, torch.full_like(versions, version))
