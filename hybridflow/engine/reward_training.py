"""The reward-model side of one rank: Bradley-Terry training of a sequence classifier on preference pairs, and
the scores of held-out pairs.

A reward model scores a sequence at its last token that is not the pad token (transformers'
``*ForSequenceClassification`` rule, which the RL reward worker relies on). The padded pass takes that score from
the model's own output; the packed pass (``use_remove_padding``) runs the real tokens only, the two answers of a
pair sharing their first tokens, and reads the head's output at the same tokens. Rows come in pairs, chosen first
(data/reward_pairs.py); micro-batches never split a pair, so a micro-batch's loss is its pairs' loss over the pairs
of the whole batch on all ranks, and the shared update loop (engine/update.py) makes that the mean pair loss's
gradient whatever the micro-batching.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.preference import bradley_terry_loss, pair_halves
from hybridflow.batch_keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    METRICS,
    PAIR_MARGIN,
    POSITION_IDS,
    RESPONSES,
    SEQUENCE_SCORE,
)
from hybridflow.engine.config import SFTEngineConfig
from hybridflow.engine.dynamic_batch import micro_batch_groups, restore_order, split_by_groups
from hybridflow.engine.flops import PassMeter
from hybridflow.engine.forward import packed_prompt_sharing, pass_work
from hybridflow.engine.optim import OptimConfig, TrainedModel
from hybridflow.engine.packing import pack, packed_forward
from hybridflow.engine.preference import pair_units
from hybridflow.engine.update import run_updates
from hybridflow.lengths import row_lengths
from hybridflow.models.loading import HEAD_NAME
from hybridflow.protocol import DataProto

RM_LOSS = "rm/loss"  # the mean pair loss of a step
RM_PAIR_METRICS = ("rm/accuracy", "rm/chosen_score", "rm/rejected_score", "rm/score_margin")


def score_columns(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """(B,) each row's scored column: its rightmost real token that is not the pad token (0 if none)."""
    scored = attention_mask.bool() & (input_ids != pad_token_id)
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (columns * scored).argmax(dim=1)


def head_module(model: nn.Module) -> nn.Module:
    """The score head (under LoRA: peft's wrapper of it, whose output is the trained copy's)."""
    names = [name for name, _ in model.named_modules() if name.split(".")[-1] == HEAD_NAME]
    if not names:
        raise ValueError(f"{type(model).__name__} has no {HEAD_NAME!r} head: not a sequence classifier")
    return model.get_submodule(min(names, key=len))


def sequence_scores(model: nn.Module, batch: DataProto, pad_token_id: int, remove_padding: bool) -> torch.Tensor:
    """(B,) fp32: each row's score, at its last token that is not the pad token."""
    tensors = batch.batch
    ids, mask = tensors[INPUT_IDS], tensors[ATTENTION_MASK]
    if not remove_padding:
        return (
            model(input_ids=ids, attention_mask=mask, position_ids=tensors[POSITION_IDS], use_cache=False)
            .logits[:, 0]
            .float()
        )
    packed = pack(ids, mask, tensors[POSITION_IDS], tensors[RESPONSES].shape[1])
    outputs: list[torch.Tensor] = []
    hook = head_module(model).register_forward_hook(lambda _module, _inputs, output: outputs.append(output))
    try:
        packed_forward(model, packed)  # its pooled output reads one token of the whole pack: the head's is used
    finally:
        hook.remove()
    token_scores = outputs[-1][0, :, 0]  # (N,) the head's output at every packed token
    columns = score_columns(ids, mask, pad_token_id)
    slots = (mask.long().cumsum(dim=1) - 1).gather(1, columns.unsqueeze(1))  # the scored token among its row's
    return token_scores[packed.segments.index.gather(1, slots).squeeze(1)].float()


class RewardTrainingEngine:
    """A sharded sequence classifier under Bradley-Terry training, and its optimizer."""

    def __init__(
        self,
        trained: TrainedModel,
        config: SFTEngineConfig,
        optim: OptimConfig,
        *,
        pad_token_id: int,
        dp_group: dist.ProcessGroup | None = None,
    ):
        self.trained = trained
        self.config = config
        self.pad_token_id = pad_token_id
        self.dp_group = dp_group  # the ranks that split the pairs (None: all); tensor-parallel peers share rows
        self.update_config = config.update_config(optim)
        self.meter = PassMeter(trained.model)

    @property
    def model(self) -> nn.Module:
        return self.trained.model

    def _micro_loss(self, micro: DataProto, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        scores = sequence_scores(self.model, micro, self.pad_token_id, self.config.use_remove_padding)
        chosen, rejected = pair_halves(scores)
        margin = pair_halves(micro.batch[PAIR_MARGIN])[0].to(scores.device)
        pairs = max((agg.global_seqs or 0.0) / 2, 1.0)  # every row has response tokens: rows / 2 of all ranks
        loss = bradley_terry_loss(chosen, rejected, margin).sum() / pairs
        chosen, rejected = chosen.detach(), rejected.detach()
        metrics = {
            RM_LOSS: loss.detach(),
            "rm/accuracy": (chosen > rejected).sum() / pairs,
            "rm/chosen_score": chosen.sum() / pairs,
            "rm/rejected_score": rejected.sum() / pairs,
            "rm/score_margin": (chosen - rejected).sum() / pairs,
        }
        return loss, metrics

    def train_batch(self, data: DataProto, seed: int) -> DataProto:
        """One optimizer step over this rank's pairs (their share of the global batch), metrics in the output."""
        metrics = run_updates(
            self.trained,
            data,
            self.update_config,
            self.meter,
            pass_name="rm_update",
            prefix="rm",
            mini_batch_size=len(data),
            seed=seed,
            micro_loss=self._micro_loss,
            loss_share_keys=(RM_LOSS, *RM_PAIR_METRICS),
            dp_group=self.dp_group,
            row_units=pair_units,
        )
        return DataProto(meta_info={METRICS: metrics})

    @torch.no_grad()
    def evaluate(self, data: DataProto) -> DataProto:
        """``sequence_score`` (B,): each row's score, micro-batch by micro-batch (a collective with
        ``use_dynamic_bsz``: every rank runs as many micro-batches)."""
        start = time.perf_counter()
        cfg = self.config
        self.model.eval()
        sharing = packed_prompt_sharing(data, cfg.use_remove_padding)
        max_tokens = cfg.max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        groups = micro_batch_groups(row_lengths(data), cfg.micro_batch_size_per_gpu, max_tokens, sharing)
        parts = [
            sequence_scores(self.model, micro, self.pad_token_id, cfg.use_remove_padding)
            for micro in split_by_groups(data, groups)
        ]
        work = pass_work(data, cfg.use_remove_padding)
        metrics = self.meter.metrics("rm_eval", work, time.perf_counter() - start, training=False)
        return DataProto.from_dict({SEQUENCE_SCORE: restore_order(parts, groups)}, meta_info={METRICS: metrics})
