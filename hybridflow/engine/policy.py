"""The actor's training side: old log-probs and the PPO-family policy update on one rank.

Both passes return a DataProto: their tensors, and their measurements in ``meta_info[METRICS]``
(the one way a worker hands metrics back).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives import OBJECTIVES, ForwardOutputs
from hybridflow.batch_keys import (
    ENTROPYS,
    METRICS,
    OLD_LOG_PROBS,
    OLD_POLICY,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
)
from hybridflow.engine.config import ActorConfig
from hybridflow.engine.forward import ResponseOutputs, log_probs_of, pipelined_outputs, response_outputs
from hybridflow.engine.log_prob import log_prob_pass
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.pipeline import PipelinedModel
from hybridflow.engine.update import UpdatedEngine, run_updates
from hybridflow.models.routing import RouteReplay
from hybridflow.protocol import DataProto

_ROW = "_row_in_update"  # each sample's row in the update's input, carried through shuffling and micro-batching


class FirstPass:
    """The log-probs and entropy of each row at its first forward in an update (later epochs skipped)."""

    def __init__(self, shape: torch.Size, bypass: bool):
        self.bypass = bypass  # the loss's old policy is the rollout's log-probs
        self.log_probs = torch.zeros(shape, dtype=torch.float32)
        self.entropy = torch.zeros(shape, dtype=torch.float32)
        self.seen = torch.zeros(shape[0], dtype=torch.bool)

    def record(self, rows: torch.Tensor, log_prob: torch.Tensor, entropy: torch.Tensor) -> None:
        rows = rows.cpu()
        new = ~self.seen[rows]
        self.log_probs[rows[new]] = log_prob[new.to(log_prob.device)].float().cpu()
        self.entropy[rows[new]] = entropy[new.to(entropy.device)].float().cpu()
        self.seen[rows] = True

    def tensors(self) -> dict[str, torch.Tensor]:
        return {OLD_LOG_PROBS: self.log_probs, ENTROPYS: self.entropy}


class PolicyEngine(UpdatedEngine):
    """A sharded policy model with its optimizer and learning-rate schedule (``UpdatedEngine``'s arguments)."""

    config: ActorConfig

    def __init__(self, trained: TrainedModel, config: ActorConfig, **groups: dist.ProcessGroup | None):
        super().__init__(trained, config, **groups)
        self.objective = OBJECTIVES.get("policy")(config)
        self.route_replay = RouteReplay() if config.router_replay.replays else None  # routing replay's counts

    def compute_log_prob(self, data: DataProto, temperature: float, with_entropy: bool) -> DataProto:
        """Old log-probs (and entropy), (B, R) each, with the pass's FLOP/s as metrics. Routing replay: R3 routes the
        pass as the rollout did; R2 returns the experts it routed each token to, for the update to replay."""
        mode = self.config.router_replay.mode
        routes = [] if mode == "R2" else None
        log_probs, entropy, metrics = log_prob_pass(
            self.model,
            self.meter,
            data,
            self.config,
            pass_name="log_prob",
            temperature=temperature,
            with_entropy=with_entropy,
            sp_group=self.sp_group,
            replay_routes=self.route_replay if mode == "R3" else None,
            routes=routes,
        )
        if self.route_replay is not None:
            metrics |= self.route_replay.metrics("log_prob", self._stage_group())
        tensors = {OLD_LOG_PROBS: log_probs} | ({ENTROPYS: entropy} if with_entropy else {})
        if routes:
            tensors[ROUTED_EXPERTS] = routes[0]
        return DataProto.from_dict(tensors, meta_info={METRICS: metrics})

    def _stage_group(self) -> dist.ProcessGroup | None:
        """The ranks whose routing-replay counts make up the model's: a pipelined model's pp group (each rank replays
        its stages' layers)."""
        return self.model.group if isinstance(self.model, PipelinedModel) else None

    def outputs(self, micro: DataProto) -> ResponseOutputs:
        """The model's outputs on a micro-batch's response tokens, with gradients; routed as the rollout routed them
        with routing replay."""
        return response_outputs(self.model, micro, self.config.use_remove_padding, self.sp_group, self.route_replay)

    def _micro_loss(
        self,
        micro: DataProto,
        agg: LossAggregation,
        outputs: ResponseOutputs,
        temperature: float,
        first_pass: FirstPass | None,
    ) -> tuple[torch.Tensor, dict]:
        objective, batch = self.objective, micro.batch
        log_prob, entropy = log_probs_of(
            outputs,
            micro,
            temperature,
            with_entropy=objective.entropy_in_loss or first_pass is not None,
            entropy_grad=objective.entropy_in_loss,
        )
        if first_pass is not None:
            first_pass.record(batch[_ROW], log_prob.detach(), entropy.detach())
        if OLD_LOG_PROBS in batch.keys():
            old_log_prob = batch[OLD_LOG_PROBS]
        elif first_pass.bypass:  # the rollout's log-probs are the old policy
            old_log_prob = batch[ROLLOUT_LOG_PROBS]
        else:  # one optimizer step on this batch: before it, the current log-probs are the old ones, exactly
            old_log_prob = log_prob.detach()
        columns = {key: batch[key] for key in batch.keys()} | {OLD_LOG_PROBS: old_log_prob}
        return objective.loss(ForwardOutputs(log_probs=log_prob, entropy=entropy), columns, agg)

    def update_policy(self, data: DataProto, mini_batch_size: int, temperature: float, seed: int) -> DataProto:
        """PPO epochs over this rank's batch; metrics include ``perf/mfu_update`` and ``perf/tflops_update``.

        Without ``old_log_probs`` in ``data`` the old policy is either the rollout's log-probs
        (``meta_info[OLD_POLICY] == "rollout"``, the bypass mode) or, for a single optimizer step on
        the batch (``ActorConfig.single_update_step``), the update's own log-probs before that step.
        Either way the log-probs (and entropy) of each row's first forward in the update come back as
        the output's ``old_log_probs`` / ``entropys`` ((B, R), ``data``'s order): the trainer's view of
        the sampled tokens, for the metrics. With old log-probs given, the output holds the metrics alone.
        """
        data, first_pass = self._first_pass(data, mini_batch_size)
        metrics = run_updates(
            self.trained,
            data,
            self.config,
            self.meter,
            pass_name="update",
            prefix="actor",
            mini_batch_size=mini_batch_size,
            seed=seed,
            forward=self.outputs,
            micro_loss=lambda micro, agg, outputs: self._micro_loss(micro, agg, outputs, temperature, first_pass),
            dp_group=self.dp_group,
            loss_share_keys=self.objective.share_keys,
            staged=functools.partial(pipelined_outputs, replay=self.route_replay),
            sp_group=self.sp_group,
        )
        if self.route_replay is not None:
            metrics |= self.route_replay.metrics("update", self._stage_group())
        tensors = first_pass.tensors() if first_pass is not None else None
        if tensors is not None and isinstance(self.model, PipelinedModel):  # the last stage computed them
            tensors = self.model.share_from_last(tensors)
        return DataProto.from_dict(tensors, meta_info={METRICS: metrics})

    def _first_pass(self, data: DataProto, mini_batch_size: int) -> tuple[DataProto, FirstPass | None]:
        """Given old log-probs: ``data`` as it is and None. Else ``data`` with each row's index (in a new
        TensorDict, so that the index stays out of the caller's batch) and the FirstPass to fill."""
        if OLD_LOG_PROBS in data.batch.keys():
            return data, None
        bypass = data.meta_info.get(OLD_POLICY) == "rollout"
        if not bypass and not self.config.single_update_step(mini_batch_size, len(data)):
            raise ValueError(
                f"the batch has no old_log_probs, but the update is not one optimizer step on it "
                f"({self.config.ppo_epochs} epoch(s), mini-batches of {mini_batch_size} of {len(data)} samples): "
                "compute old log-probs first"
            )
        data = data.select(batch_keys=list(data.batch.keys()))
        data.batch[_ROW] = torch.arange(len(data))
        return data, FirstPass(data.batch[RESPONSES].shape, bypass)
