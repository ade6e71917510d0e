"""What the supervised trainers share (SFT's, DPO's): one worker group on one pool fed from a resumable loader, its
checkpoint (the group's model state and the loader's position), its timeline lane, nothing in the background.

A trainer adds ``step`` (a batch to the group, its metrics) and ``validate``; the step loop (step_loop.py) does the
rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from hybridflow.controller import RayWorkerGroup
from hybridflow.data import PromptDataLoader
from hybridflow.protocol import DataProto
from hybridflow.trainer.loop.batch_source import train_batches
from hybridflow.trainer.loop.step_loop import CheckpointParts
from hybridflow.trainer.services.timeline import StepTimeline


class SupervisedTrainer:
    def __init__(
        self,
        group: RayWorkerGroup,
        pool: str,
        dp_size: int,
        loader: PromptDataLoader,
        val_batches: Callable[[], Iterator[DataProto]] | None,
        *,
        total_epochs: int,
    ):
        self.group = group
        self.pool = pool  # the name of the group's pool, its lane in the timeline
        self.dp_size = dp_size  # the data-parallel ranks the rows split over
        self.loader = loader
        self.val_batches = val_batches
        self.batches = train_batches(loader, total_epochs)

    def begin(self, step: int, timeline: StepTimeline) -> None:
        pass

    def checkpoint(self, step: int) -> CheckpointParts:
        group = self.group
        return CheckpointParts(
            state={"data_loader": self.loader.state_dict()},
            write=lambda directory: group.save_checkpoint(str(directory)),
        )

    def restore(self, checkpoint: Path, state: dict) -> None:
        self.group.load_checkpoint(str(checkpoint))
        self.loader.load_state_dict(state["data_loader"])

    def collect_spans(self, timeline: StepTimeline) -> None:
        timeline.collect_group(self.pool, self.group)

    def end(self, failed: bool) -> None:
        pass  # nothing runs in the background
