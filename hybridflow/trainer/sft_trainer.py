"""The driver's SFT loop: batches of labelled samples to the ``sft`` worker group, one optimizer step each.

    batch -> balance tokens over ranks -> train_batch -> metrics -> (validation loss) -> (checkpoint)

The same machinery as the RL loop around it: the loader's resumable position, atomic verified checkpoints
(trainer/checkpoint.py) holding the model's state in the actor's layout (``hybridflow export`` reads them),
the trackers, the progress display and ``hybridflow report``'s metrics file.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hybridflow.batch_keys import ATTENTION_MASK, GLOBAL_STEP, METRICS, RESPONSE_MASK
from hybridflow.controller import WorkerGroup
from hybridflow.data import PromptDataLoader
from hybridflow.engine.sft import LOSS, LOSS_TOKENS, NLL_SUM
from hybridflow.lengths import balanced_order, row_lengths
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.trainer.checkpoint import CheckpointManager, read_trainer_state
from hybridflow.trainer.progress import RunProgress
from hybridflow.trainer.sft_config import SFTConfig
from hybridflow.trainer.tracking import Tracking

VAL_LOSS = "val/loss"  # mean negative log-likelihood per trained held-out token
VAL_PERPLEXITY = "val/perplexity"  # exp(val/loss)
SFT_SHOWN = ((LOSS, "loss"), (VAL_LOSS, "val loss"))  # what the progress line shows


class SFTTrainer:
    def __init__(
        self,
        config: SFTConfig,
        group: WorkerGroup,
        dp_size: int,
        train_loader: PromptDataLoader,
        val_batches: Callable[[], Iterator[DataProto]] | None,
        tracking: Tracking,
        total_steps: int,
        run_dir: Path,
    ):
        self.config = config
        self.group = group
        self.dp_size = dp_size  # the data-parallel ranks the rows split over
        self.train_loader = train_loader
        self.val_batches = val_batches
        self.tracking = tracking
        self.total_steps = total_steps
        self.run_dir = run_dir
        self.checkpoints = CheckpointManager(run_dir, config.trainer.max_ckpt_to_keep)
        self.global_step = 0

    def fit(self, resume_from: Path | None = None) -> dict[str, float]:
        """Train to ``total_steps``, first resuming from ``resume_from`` (a verified checkpoint) if given."""
        if resume_from is not None:
            self.resume(resume_from)
        metrics: dict[str, float] = {}
        if self.global_step >= self.total_steps:
            print(f"nothing to train: the run is at step {self.global_step} of {self.total_steps}")
            return metrics
        trainer = self.config.trainer
        with RunProgress(self.total_steps, start_step=self.global_step, shown=SFT_SHOWN) as progress:
            if self.val_batches is not None and trainer.val_before_train and self.global_step == 0:
                with progress.stage("validation"):
                    self.tracking.log(self.validate(), step=0)
            for batch in self.batches():
                self.global_step += 1
                metrics = self.train_step(batch)
                last = self.global_step >= self.total_steps
                if self.val_batches is not None and (
                    last or (trainer.test_freq > 0 and self.global_step % trainer.test_freq == 0)
                ):
                    with progress.stage("validation"):
                        metrics.update(self.validate())
                if trainer.save_freq > 0 and (last or self.global_step % trainer.save_freq == 0):
                    start = time.time()
                    with progress.stage("save_checkpoint"):
                        self.save_checkpoint()
                    metrics["timing_s/save_checkpoint"] = time.time() - start
                self.tracking.log(metrics, step=self.global_step)
                progress.step_done(self.global_step, metrics)
                if last:
                    break
        return metrics

    def batches(self) -> Iterator[DataProto]:
        while self.train_loader.state_dict()["epoch"] < self.config.trainer.total_epochs:
            yield from self.train_loader

    def balanced(self, batch: DataProto) -> DataProto:
        """The rows reordered so that each data-parallel rank's contiguous share holds about as many tokens."""
        return batch.reorder(balanced_order(row_lengths(batch), self.dp_size))

    def train_step(self, batch: DataProto) -> dict[str, float]:
        start = time.time()
        batch = self.balanced(batch)
        batch.meta_info[GLOBAL_STEP] = self.global_step
        output = self.group.train_batch(batch)
        metrics = dict(output.meta_info.pop(METRICS, {}))
        seconds = time.time() - start
        tokens = int(batch.batch[ATTENTION_MASK].sum())
        metrics.update(
            {
                "timing_s/step": seconds,
                "train/tokens": float(tokens),
                "train/trained_tokens": float(batch.batch[RESPONSE_MASK].sum()),
                "train/samples": float(len(batch)),
                "train/epoch": float(self.train_loader.state_dict()["epoch"]),
                "perf/tokens_per_second": tokens / seconds,
                "perf/driver_rss_gb": resident_gb(),
            }
        )
        return metrics

    def validate(self) -> dict[str, float]:
        """The held-out set's mean negative log-likelihood per trained token, and its perplexity."""
        nll, tokens = 0.0, 0.0
        for batch in self.val_batches():
            padded, pad = self.balanced(batch).pad_to_divisor(self.dp_size)  # every rank runs as many passes
            output = self.group.evaluate(padded).unpad(pad)
            nll += float(output.batch[NLL_SUM].double().sum())
            tokens += float(output.batch[LOSS_TOKENS].double().sum())
        loss = nll / max(tokens, 1.0)
        return {VAL_LOSS: loss, VAL_PERPLEXITY: math.exp(min(loss, 80.0)), "val/tokens": tokens}

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        state = {"global_step": self.global_step, "data_loader": self.train_loader.state_dict()}
        return self.checkpoints.save(
            self.global_step, lambda directory: self.group.save_checkpoint(str(directory)), state
        )

    def resume(self, checkpoint: Path) -> None:
        state = read_trainer_state(checkpoint)  # before the workers load: a bad one fails here, not in them
        self.group.load_checkpoint(str(checkpoint))
        self.global_step = state["global_step"]
        self.train_loader.load_state_dict(state["data_loader"])
        print(f"resumed from {checkpoint} at step {self.global_step}")
