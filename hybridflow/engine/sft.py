"""The supervised side of one rank: the negative log-likelihood update and the held-out loss.

Batches come in the RL step's layout (data/sft_dataset.py): ``responses`` and ``response_mask`` (B, R) mark
the trained tokens, so the loss is the policy's log-probs of the response tokens (engine/forward.py, packed
or padded, any micro-batching) averaged over every trained token of the batch on all ranks: the shared
update loop (engine/update.py) makes each micro-batch's loss its share of that global mean.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms import LossAggregation, agg_loss
from hybridflow.batch_keys import LOSS_TOKENS, METRICS, NLL_SUM, RESPONSE_MASK, SFT_LOSS
from hybridflow.engine.config import SFTEngineConfig
from hybridflow.engine.flops import PassMeter
from hybridflow.engine.forward import batched_log_probs, pass_work, response_log_probs
from hybridflow.engine.optim import OptimConfig, TrainedModel
from hybridflow.engine.update import run_updates
from hybridflow.protocol import DataProto


class SFTEngine:
    """A sharded model under supervised training, with its optimizer and learning-rate schedule."""

    def __init__(
        self,
        trained: TrainedModel,
        config: SFTEngineConfig,
        optim: OptimConfig,
        dp_group: dist.ProcessGroup | None = None,
    ):
        self.dp_group = dp_group  # the ranks that split the rows (None: all); tensor-parallel peers share rows
        self.trained = trained
        self.config = config
        self.update_config = config.update_config(optim)
        self.meter = PassMeter(trained.model)

    @property
    def model(self) -> nn.Module:
        return self.trained.model

    def _micro_loss(self, micro: DataProto, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        log_probs, _ = response_log_probs(self.model, micro, remove_padding=self.config.use_remove_padding)
        loss = agg_loss(-log_probs, micro.batch[RESPONSE_MASK], agg)
        return loss, {SFT_LOSS: loss.detach()}

    def train_batch(self, data: DataProto, seed: int) -> DataProto:
        """One optimizer step over this rank's rows (their share of the global batch), metrics in the output."""
        metrics = run_updates(
            self.trained,
            data,
            self.update_config,
            self.meter,
            pass_name="sft_update",
            prefix="sft",
            mini_batch_size=len(data),
            seed=seed,
            micro_loss=self._micro_loss,
            loss_share_keys=(SFT_LOSS,),
            dp_group=self.dp_group,
        )
        return DataProto(meta_info={METRICS: metrics})

    def evaluate(self, data: DataProto) -> DataProto:
        """Each row's summed negative log-likelihood and trained-token count (B,), without gradients: the caller
        sums them over the held-out set for its loss and perplexity."""
        cfg = self.config
        self.model.eval()
        start = time.perf_counter()
        log_probs, _ = batched_log_probs(
            self.model,
            data,
            cfg.micro_batch_size_per_gpu,
            temperature=1.0,
            with_entropy=False,
            remove_padding=cfg.use_remove_padding,
            max_token_len=cfg.max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
        )
        mask = data.batch[RESPONSE_MASK].float()
        work = pass_work(data, cfg.use_remove_padding)
        metrics = self.meter.metrics("sft_eval", work, time.perf_counter() - start, training=False)
        return DataProto.from_dict(
            {NLL_SUM: -(log_probs * mask).sum(dim=1), LOSS_TOKENS: mask.sum(dim=1)}, meta_info={METRICS: metrics}
        )
