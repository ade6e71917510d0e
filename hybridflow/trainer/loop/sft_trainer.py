"""The SFT trainer: batches of labelled samples to the ``sft`` worker group, one optimizer step each.

    batch -> balance tokens over ranks -> train_batch -> metrics

The step loop (step_loop.py) runs it as it runs RL: the loader's resumable position, atomic verified
checkpoints (trainer/services/checkpoint.py) holding the model's state in the actor's layout (``hybridflow export``
reads them), validation when due (the held-out loss), the trackers, the progress display, the timeline and
``hybridflow report``'s metrics file.
"""

from __future__ import annotations

import math
import time

from hybridflow.batch_keys import ATTENTION_MASK, GLOBAL_STEP, LOSS_TOKENS, METRICS, NLL_SUM, RESPONSE_MASK, SFT_LOSS
from hybridflow.lengths import balanced_order, row_lengths
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.trainer.loop.step_loop import Metrics
from hybridflow.trainer.loop.supervised_trainer import SupervisedTrainer
from hybridflow.trainer.services.timeline import StepTimeline

VAL_LOSS = "val/loss"  # mean negative log-likelihood per trained held-out token
VAL_PERPLEXITY = "val/perplexity"  # exp(val/loss)
SFT_SHOWN = ((SFT_LOSS, "loss"), (VAL_LOSS, "val loss"))  # what the progress line shows


class SFTTrainer(SupervisedTrainer):
    shown = SFT_SHOWN

    def step(self, step: int, timeline: StepTimeline) -> Metrics | None:
        batch = next(self.batches, None)
        if batch is None:
            return None
        start = time.time()
        batch = self.balanced(batch)
        batch.meta_info[GLOBAL_STEP] = step
        with timeline.stage("train_batch"):
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
                "train/epoch": float(self.loader.state_dict()["epoch"]),
                "perf/tokens_per_second": tokens / seconds,
                "perf/driver_rss_gb": resident_gb(),
            }
        )
        return metrics

    def balanced(self, batch: DataProto) -> DataProto:
        """The rows reordered so that each data-parallel rank's contiguous share holds about as many tokens."""
        return batch.reorder(balanced_order(row_lengths(batch), self.dp_size))

    def validate(self, step: int, timeline: StepTimeline) -> Metrics:
        """The held-out set's mean negative log-likelihood per trained token, and its perplexity."""
        nll, tokens = 0.0, 0.0
        for batch in self.val_batches():
            padded, pad = self.balanced(batch).pad_to_divisor(self.dp_size)  # every rank runs as many passes
            output = self.group.evaluate(padded).unpad(pad)
            nll += float(output.batch[NLL_SUM].double().sum())
            tokens += float(output.batch[LOSS_TOKENS].double().sum())
        loss = nll / max(tokens, 1.0)
        return {VAL_LOSS: loss, VAL_PERPLEXITY: math.exp(min(loss, 80.0)), "val/tokens": tokens}
