"""The update step of the actor and the critic, written once: mini-batches for optimizer steps,
micro-batches for accumulation, timed with the step's FLOP/s; each role gives its micro-batch loss.

Loss normalisation across micro-batches *and* data-parallel ranks: the loss aggregation is told
the token and sequence counts of the whole mini-batch over all ranks, so each micro-batch loss
is its share of the global mean. FSDP averages gradients over ranks; multiplying the loss by the
world size turns that average into the sum of shares, i.e. the gradient of the global mean.
This holds for any partition of the mini-batch into micro-batches, so micro-batches formed by
token count (``max_token_len``) give the same gradient as fixed-size ones, and so do micro-batches
that keep the rows of one prompt together after a shuffle (packed passes then compute the prompt
once per micro-batch: ``dynamic_batch.micro_batch_groups``); every loss still sees the (B, R)
layout, so the response length used by ``seq-mean-token-sum-norm`` is unchanged too. "The same"
up to float rounding: a partition changes the order in which gradients are summed. The same holds for
how the rows split over data-parallel ranks (tests/engine/test_fsdp_actor.py), and for the metrics: each
is the mini-batch's, a micro-batch's value weighted by its share of the mini-batch's response tokens
over all ranks (a clip fraction or an approximate KL, token means, come out as the mini-batch's).
Which rows share a mini-batch is each rank's k-th share of its rows: with several mini-batches per step,
that depends on the split.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms import LossAggregation
from hybridflow.batch_keys import RESPONSE_MASK
from hybridflow.engine.config import UpdateConfig
from hybridflow.engine.dynamic_batch import micro_batch_groups, split_by_groups
from hybridflow.engine.flops import PassMeter, pass_work
from hybridflow.engine.forward import (
    ResponseOutputs,
    packed_prompt_sharing,
    pipelined_outputs,
    response_outputs,
)
from hybridflow.engine.fsdp import gathered_through_backward, grad_norm_and_clip, keeps_gathered_weights
from hybridflow.engine.moe import balancing_loss_and_metrics, recording_routers
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.pipeline import PipelinedModel
from hybridflow.engine.sequence_parallel import sp_size
from hybridflow.lengths import row_lengths
from hybridflow.models.routing import configured_balancing_weight
from hybridflow.protocol import DataProto

# (micro-batch, the mini-batch's loss aggregation, the model's outputs on it) -> its loss and metrics
MicroLossFn = Callable[[DataProto, LossAggregation, Any], tuple[torch.Tensor, dict[str, float]]]
# a pipelined model's pass over micro-batches (forward.py ``pipelined_outputs``' signature): the loss of each on the
# last stage, backwarded by the schedule
StagedForward = Callable[..., Any]


class UpdatedEngine:
    """What the actor's and the critic's engines share: the sharded model with its optimizer (``trained``), the role's
    config, the ranks it splits rows over (``dp_group``; None: all, tensor- and sequence-parallel peers sharing rows)
    and each micro-batch's tokens over (``sp_group``, Ulysses; None: none), and the meter of its passes' FLOP/s."""

    def __init__(
        self,
        trained: TrainedModel,
        config: UpdateConfig,
        dp_group: dist.ProcessGroup | None = None,
        sp_group: dist.ProcessGroup | None = None,
    ):
        self.trained = trained
        self.config = config
        self.dp_group = dp_group
        self.sp_group = sp_group
        self.meter = PassMeter(trained.model, sp_size(sp_group))  # measures the device's peak FLOP/s once per process

    @property
    def model(self) -> nn.Module:
        """The model under training (``trained.model``)."""
        return self.trained.model

    def outputs(self, micro: DataProto) -> ResponseOutputs:
        """The model's outputs on a micro-batch's response tokens, with gradients."""
        return response_outputs(self.model, micro, self.config.use_remove_padding, self.sp_group)


def global_aggregation(
    mode: str, response_mask: torch.Tensor, dp_group: dist.ProcessGroup | None = None
) -> LossAggregation:
    """LossAggregation whose totals are the mini-batch's over every data-parallel rank (``dp_group``;
    None: all ranks)."""
    mask = response_mask.bool()
    counts = torch.tensor([mask.sum(), mask.any(dim=-1).sum()], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(counts, group=dp_group)
    return LossAggregation(
        mode, global_tokens=float(counts[0]), global_seqs=float(counts[1]), norm_constant=float(response_mask.shape[-1])
    )


def _to_float(value: torch.Tensor | float) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def run_updates(
    trained: TrainedModel,
    data: DataProto,
    config: UpdateConfig,
    meter: PassMeter,
    *,
    pass_name: str,
    prefix: str,
    mini_batch_size: int,
    seed: int,
    forward: Callable[[DataProto], Any],
    micro_loss: MicroLossFn,
    loss_share_keys: tuple[str, ...] = (),
    dp_group: dist.ProcessGroup | None = None,
    row_units: Callable[[DataProto], Sequence[int]] | None = None,
    staged: StagedForward = pipelined_outputs,
    sp_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """One training step's optimizer steps over ``data`` (this rank's share), then one scheduler step.

    ``forward`` gives the model's outputs on a micro-batch and ``micro_loss`` its loss and metrics from them (a
    pipelined model's stages give them through ``staged`` instead: ``response_outputs`` by default, the sequence
    scores with sequence_scores.py ``pipelined_scores``; the last stage computes the loss; ``sp_group``: the
    Ulysses ranks they split each micro-batch's tokens over). ``prefix``
    names the step's own metrics (``<prefix>/grad_norm``, ``<prefix>/skipped_steps``, ``<prefix>/lr``) and
    ``pass_name`` its FLOP/s over all epochs (``perf/mfu_<pass_name>``, ``perf/tflops_<pass_name>``, ``meter``).
    Metrics are the mini-batch's whatever its micro-batches and ranks: a micro-batch's value weighted by its
    share of the mini-batch's response tokens over all ranks (token means come out exact), except
    ``loss_share_keys``: those are each micro-batch's share of the global mini-batch loss, so they are
    summed as they are. Both are scaled by the world size, so that the driver's mean over ranks is the
    mini-batch's; a step's metric is the mean over its mini-batches (and epochs).
    With ``config.use_dynamic_bsz`` micro-batches hold at most ``config.ppo_max_token_len_per_gpu``
    real tokens (collective: every rank runs as many micro-batches).
    ``row_units``: a key per row of a mini-batch; rows with one key share every micro-batch (a preference pair's
    two answers). Mini-batches are then never shuffled: ``config.shuffle`` must be off.
    """
    if row_units is not None and config.shuffle:
        raise ValueError("rows kept together in units cannot be shuffled between mini-batches: set shuffle off")
    start = time.perf_counter()
    model, optimizer, scheduler = trained.model, trained.optimizer, trained.scheduler
    # the data-parallel size: FSDP2 averages gradients over these ranks (tensor-parallel peers share rows)
    world_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    max_token_len = config.ppo_max_token_len_per_gpu if config.use_dynamic_bsz else None
    totals: dict[str, list[float]] = defaultdict(list)
    model.train()
    for mini_batch in data.make_iterator(mini_batch_size, epochs=config.ppo_epochs, shuffle=config.shuffle, seed=seed):
        agg = global_aggregation(config.loss_agg_mode, mini_batch.batch[RESPONSE_MASK], dp_group)
        optimizer.zero_grad(set_to_none=True)
        sharing = packed_prompt_sharing(mini_batch, config.use_remove_padding)  # packed: keep prompts together
        size = config.ppo_micro_batch_size_per_gpu
        units = row_units(mini_batch) if row_units is not None else None
        groups = micro_batch_groups(row_lengths(mini_batch), size, max_token_len, sharing, units)
        shares: dict[str, float] = defaultdict(float)
        micro_batches = split_by_groups(mini_batch, groups)
        backwarded = _backward(
            model, micro_batches, agg, world_size, forward, micro_loss, config, staged, prefix, sp_group
        )
        for micro_batch, metrics in zip(micro_batches, backwarded):
            tokens = float(micro_batch.batch[RESPONSE_MASK].sum())
            token_share = tokens / max(agg.global_tokens or 0.0, 1.0)  # of the mini-batch's, all ranks
            for key, value in metrics.items():
                if key in loss_share_keys:
                    shares[key] += value * world_size
                elif tokens:  # a micro-batch without response tokens has no share (and mean metrics of nothing)
                    shares[key] += value * token_share * world_size
        for key, value in shares.items():
            totals[key].append(value)
        if isinstance(model, PipelinedModel):
            grad_norm = model.grad_norm_and_clip(config.grad_clip)
        else:
            grad_norm = grad_norm_and_clip(model, config.grad_clip)
        finite = bool(torch.isfinite(torch.tensor(grad_norm)))
        if finite:
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
        totals[f"{prefix}/grad_norm"].append(grad_norm)
        totals[f"{prefix}/skipped_steps"].append(0.0 if finite else 1.0)
    optimizer.zero_grad(set_to_none=True)  # nothing reads them until the next step: free them for generation
    model.eval()
    metrics = {key: sum(values) / len(values) for key, values in totals.items()}
    metrics[f"{prefix}/lr"] = scheduler.get_last_lr()[0]
    scheduler.step()
    work = pass_work(data, config.use_remove_padding)
    metrics.update(meter.metrics(pass_name, work, time.perf_counter() - start, True, config.ppo_epochs))
    return metrics


def _backward(
    model: nn.Module,
    micro_batches: list[DataProto],
    agg: LossAggregation,
    world_size: int,
    forward: Callable[[DataProto], Any],
    micro_loss: MicroLossFn,
    config: UpdateConfig,
    staged: StagedForward,
    prefix: str,
    sp_group: dist.ProcessGroup | None = None,
) -> list[dict[str, float]]:
    """Each micro-batch's loss, scaled by the data-parallel size (FSDP2 averages over it), backwarded; its metrics.
    A pipelined model's schedule runs the micro-batches through its stages, the last stage computing the losses,
    and every rank of the pp group gets the metrics. A mixture of experts adds its routers' balancing loss
    (engine/moe.py), each micro-batch's weighted by 1 / their count, and averaged over the data-parallel ranks (a
    mean over every rank's micro-batches, whatever their number); in stages, the last stage computes it from the
    routing statistics that every stage adds its layers' to (engine/pipeline_stages.py ``StageForward``)."""
    if isinstance(model, PipelinedModel):
        metrics: dict[int, dict[str, float]] = {}

        def staged_loss(index: int, outputs: Any) -> torch.Tensor:
            loss, values = micro_loss(micro_batches[index], agg, outputs)
            metrics[index] = {key: _to_float(value) for key, value in values.items()}
            return loss * world_size

        coefficient = 0.0
        if model.routing is not None:  # the whole model's routers (this rank's stages may hold none)
            coefficient = configured_balancing_weight(model.config, config.router_aux_loss_coef)

        def balance(index: int, statistics: torch.Tensor) -> torch.Tensor:
            loss, values = balancing_loss_and_metrics(statistics, prefix)
            metrics[index].update(values)
            return coefficient * loss / len(micro_batches)  # FSDP's mean over the ranks: the mean over theirs

        balancing = balance if coefficient else None
        staged(model, micro_batches, config.use_remove_padding, sp_group, loss=staged_loss, balance=balancing)
        return model.share_from_last([metrics[i] for i in range(len(micro_batches))] if metrics else None)
    results = []
    keep = keeps_gathered_weights(config.reshard_after_forward, next(model.parameters()).device)
    with gathered_through_backward(model, keep=keep), recording_routers(model, config.router_aux_loss_coef) as routers:
        for micro_batch in micro_batches:
            if routers is not None:
                routers.clear()
            outputs = forward(micro_batch)
            loss, values = micro_loss(micro_batch, agg, outputs)
            if routers is not None:
                # Ulysses: this rank's slice of the micro-batch (ResponseOutputs' and ScoreOutputs' shard)
                balance, balance_metrics = routers.loss_and_metrics(prefix, outputs.shard)
                # over the data-parallel ranks a mean, as FSDP takes it: the loss's sum scaling below leaves it out
                loss = loss + routers.coefficient * balance / (len(micro_batches) * world_size)
                values = {**values, **balance_metrics}
            (loss * world_size).backward()
            results.append({key: _to_float(value) for key, value in values.items()})
    return results
