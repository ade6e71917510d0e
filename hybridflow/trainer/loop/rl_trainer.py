"""The RL trainer: the dataflow of one PPO/GRPO step, one named call per stage, for every training mode.

    batch (its source: generated now, one step ahead, or from the asynchronous queue; scored, dynamic sampling)
          -> compute_log_prob -> compute_ref_log_prob -> compute_teacher_log_prob -> compute_values -> reward
          -> KL + advantage (+ the teacher's, on-policy distillation)
          -> loss masks and weights -> update_critic -> update_actor -> (the weights move) -> metrics

The mode (trainer/setup/modes.py) gives the trainer its two parts: where a step's batch comes from
(batch_source.py) and when the weights move to the generator (weight_sync.py); the step loop
(step_loop.py) runs it, with validation and checkpoints when due.

Every worker call returns a DataProto; the metrics it measured (the mean over its ranks) come in its
``meta_info[METRICS]`` and are taken out by ``take_metrics``, the one way they reach a step's metrics.
Calls to stages that do not depend on each other are issued with ``.future(...)`` and resolved where their
data is needed: on one resource pool Ray runs them in order, on different pools (``trainer.placement``) at
the same time. The step's timeline (trainer/services/timeline.py) records which pool ran what when; the
``timing_s/*`` metrics come from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from hybridflow.algorithms import apply_kl_penalty, make_kl_controller
from hybridflow.algorithms.branch_advantage import branch_advantages
from hybridflow.algorithms.distillation import distillation_advantages
from hybridflow.algorithms.rollout_correction import correction_diagnostics, rollout_correction
from hybridflow.batch_keys import (
    ADVANTAGES,
    BATCH_SCALE,
    DATA_SOURCE,
    LAST_BRANCH,
    OLD_LOG_PROBS,
    OLD_POLICY,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RETURNS,
    REWARD_BASELINES,
    ROLLOUT_IS_WEIGHTS,
    ROLLOUT_LOG_PROBS,
    SESSION,
    TEACHER_LOG_PROB,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    TRUNCATED,
    UID,
    VALUES,
)
from hybridflow.data import PromptDataLoader
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.rollout.agent_server.branch_rows import drop_fillers, pad_to_planned
from hybridflow.trainer.loop.batch_source import BatchSource
from hybridflow.trainer.loop.generation import Generation, Metrics, rank_order, take_metrics
from hybridflow.trainer.loop.step_loop import CheckpointParts
from hybridflow.trainer.loop.weight_sync import WeightSync
from hybridflow.trainer.services.metrics import (
    agent_metrics,
    data_metrics,
    generated_mask,
    log_prob_mismatch,
    throughput_metrics,
)
from hybridflow.trainer.services.progress import RL_SHOWN
from hybridflow.trainer.services.rollout_data import batch_records, write_rollout_data
from hybridflow.trainer.services.timeline import StepTimeline
from hybridflow.trainer.services.val_metrics import validation_metrics
from hybridflow.trainer.setup.config import HybridFlowConfig
from hybridflow.trainer.setup.roles import RoleGroups
from hybridflow.trainer.setup.run_plan import RunPlan


class RLTrainer:
    shown = RL_SHOWN

    def __init__(
        self,
        config: HybridFlowConfig,
        plan: RunPlan,
        groups: RoleGroups,
        generation: Generation,
        source: BatchSource,
        weights: WeightSync,
        loader: PromptDataLoader,
        val_batches: Callable[[], Iterator[DataProto]] | None,
    ):
        self.config = config
        self.plan = plan
        self.groups = groups
        self.generation = generation
        self.score = generation.score
        self.source = source
        self.weights = weights
        self.loader = loader
        self.val_batches = val_batches
        self.estimator = plan.estimator
        self.kl_ctrl = make_kl_controller(config.algorithm.kl_ctrl)
        self.last_log_prob_diff: float | None = None

    # ---- what the step loop calls ---------------------------------------------------------

    def begin(self, step: int, timeline: StepTimeline) -> None:
        """The generator gets the actor's weights where they live apart (those of a checkpoint)."""
        self.weights.begin(step, timeline)

    def step(self, step: int, timeline: StepTimeline) -> Metrics | None:
        batch_and_metrics = self.source.next(step, timeline)  # responses in rank order, scored when filtered
        if batch_and_metrics is None:
            return None
        batch, metrics = batch_and_metrics
        self.learn(batch, step, timeline, metrics)
        if self.config.trainer.rollout_data_dir:
            records = batch_records(batch, self.loader.dataset.tokenizer, step)
            write_rollout_data(self.config.trainer.rollout_data_dir, step, records)
        self.source.after_learn(step, timeline, metrics)
        self.weights.after_step(step, timeline, metrics)
        self.source.account(step, timeline, metrics)
        self.step_metrics(batch, timeline, metrics)  # the step's time: until the next batch and weights are ready
        return metrics

    def validate(self, step: int, timeline: StepTimeline) -> Metrics:
        """Mean score per data source on the held-out prompts, with the validation sampling settings."""
        sources, uids, scores = [], [], []
        with self.source.validation(step, timeline):
            for index, prompts in enumerate(self.val_batches()):
                batch = self.generation.rollout(prompts, "validate", step, {})
                sources += list(batch.non_tensor_batch[DATA_SOURCE])
                uids += [f"{index}/{uid}" for uid in batch.non_tensor_batch[UID]]
                scores += self.score(batch, {}, timeline, shaped=False).sum(dim=1).tolist()
        return validation_metrics(sources, uids, scores, n=self.config.actor_rollout_ref.rollout.val_kwargs.n)

    def checkpoint(self, step: int) -> CheckpointParts:
        """The roles' states, the loader's position and the KL coefficient, and the source's own record."""
        loader_state, files = self.source.checkpoint()
        groups = self.groups

        def write(directory: Path) -> None:
            groups.actor_rollout.save_checkpoint(str(directory))
            if groups.critic is not None:
                groups.critic.save_checkpoint(str(directory))
            for name, contents in files:
                (directory / name).write_bytes(contents)

        return CheckpointParts(state={"data_loader": loader_state, "kl_coef": self.kl_ctrl.value}, write=write)

    def restore(self, checkpoint: Path, state: dict) -> None:
        self.groups.actor_rollout.load_checkpoint(str(checkpoint))
        if self.groups.critic is not None:
            self.groups.critic.load_checkpoint(str(checkpoint))
        self.loader.load_state_dict(state["data_loader"])
        self.kl_ctrl.value = state["kl_coef"]
        self.source.restore(checkpoint, state["global_step"])

    def collect_spans(self, timeline: StepTimeline) -> None:
        self.source.collect_spans(timeline)

    def end(self, failed: bool) -> None:
        self.source.end(failed)

    # ---- the step after generation --------------------------------------------------------

    def learn(self, batch: DataProto, step: int, timeline: StepTimeline, metrics: Metrics) -> None:
        """Everything of a step after generation: log-probs, values, advantages, the updates."""
        groups = self.groups
        # the stages that read only the responses, issued at once: where their pools differ, they run together
        # (the old log-probs, then each role's scoring pass: the reference's, the critic's values, the teacher's, ...)
        after_generation = [self.old_log_probs(batch, step, metrics)]
        after_generation += [getattr(group, method).future(batch) for group, method in groups.scoring_passes()]
        if TOKEN_LEVEL_SCORES not in batch.batch.keys():
            batch.batch[TOKEN_LEVEL_SCORES] = self.score(batch, metrics, timeline, shaped=True)
        with timeline.stage("log-probs and values"):
            for output in after_generation:
                if output is not None:
                    batch.union(take_metrics(output.get(), metrics))
        if after_generation[0] is not None:
            self.measure_log_prob_mismatch(batch, metrics)
        with timeline.stage("adv", on_driver=True):
            self.pad_branching_batch(batch)
            self.compute_advantage(batch, metrics)
            self.loss_masks_and_weights(batch, metrics)
        critic_update = groups.critic.update_critic.future(batch) if groups.critic is not None else None
        if step > self.config.trainer.critic_warmup:
            with timeline.stage("update_actor"):
                self.update_actor(batch, metrics)
        if critic_update is not None:
            with timeline.stage("update_critic"):
                take_metrics(critic_update.get(), metrics)
        drop_fillers(batch)

    def pad_branching_batch(self, batch: DataProto) -> None:
        """A batch that agent sessions' branches made larger than planned: padded with inert rows to a whole
        multiple of the planned batch (the update's mini-batches grow by it), in rank order again."""
        planned = self.config.data.train_batch_size * self.config.actor_rollout_ref.rollout.n
        scale = pad_to_planned(batch, planned)
        if scale > 1:
            batch.meta_info[BATCH_SCALE] = scale
            batch.reorder(rank_order(batch, self.generation.actor_ranks))

    def step_metrics(self, batch: DataProto, timeline: StepTimeline, metrics: Metrics) -> None:
        """What the step's data and timeline say, at its end: lengths, scores, agent turns, each stage's
        seconds and the throughput."""
        self.collect_spans(timeline)
        timings = timeline.stage_seconds() | {"step": time.time() - timeline.start}
        metrics.update(data_metrics(batch, self.config.actor_rollout_ref.rollout.response_length))
        metrics.update(agent_metrics(batch))
        metrics.update(throughput_metrics(batch, timings, self.plan.placement.processes))
        metrics["perf/driver_rss_gb"] = resident_gb()

    def old_log_probs(self, batch: DataProto, step: int, metrics: Metrics) -> DataProtoFuture | None:
        """The trainer's log-probs of the sampled tokens (a pending pass), or None where the update supplies
        the old policy: the generator's log-probs when configured (and, for auto, close), or its own."""
        rollout = self.config.actor_rollout_ref.rollout
        use_rollout = rollout.old_log_prob_source == "rollout" or (
            rollout.old_log_prob_source == "auto"
            and self.last_log_prob_diff is not None
            and self.last_log_prob_diff < rollout.log_prob_tolerance
            and step % rollout.log_prob_check_every != 0
        )
        metrics["rollout/used_rollout_log_probs"] = float(use_rollout)
        batch.meta_info[OLD_POLICY] = "rollout" if use_rollout else "trainer"
        if use_rollout or self.plan.on_policy_update:
            return None  # the update takes its old policy as configured, and returns the trainer's log-probs
        return self.groups.actor_rollout.compute_log_prob.future(batch)

    def loss_masks_and_weights(self, batch: DataProto, metrics: Metrics) -> None:
        """What leaves the updates, and how the policy loss weighs the rest (after the advantages, which
        every sample shapes): the rollout correction's weights and rejections, and truncated responses."""
        algorithm, tensors = self.config.algorithm, batch.batch
        correction = algorithm.rollout_correction
        if correction.enabled:  # on_policy_update is off then: the old log-probs are here
            result = rollout_correction(
                tensors[OLD_LOG_PROBS], tensors[ROLLOUT_LOG_PROBS], tensors[RESPONSE_MASK], correction
            )
            metrics.update(result.metrics)
            tensors[RESPONSE_MASK] = tensors[RESPONSE_MASK] * result.keep
            if result.weights is not None:
                tensors[ROLLOUT_IS_WEIGHTS] = result.weights
        if algorithm.mask_truncated_responses:
            truncated = tensors[TRUNCATED]
            tensors[RESPONSE_MASK] = tensors[RESPONSE_MASK] * ~truncated[:, None]
            metrics["response/masked_truncated_ratio"] = truncated.float().mean().item()

    def update_actor(self, batch: DataProto, metrics: Metrics) -> None:
        """The policy update; without old log-probs (an on-policy step, or the rollout's as the old
        policy), it returns the trainer's log-probs of each row's first forward (and entropy), for the metrics."""
        computed_old_log_probs = OLD_LOG_PROBS not in batch.batch.keys()
        batch.union(take_metrics(self.groups.actor_rollout.update_actor(batch), metrics))
        if computed_old_log_probs:
            self.measure_log_prob_mismatch(batch, metrics)

    def measure_log_prob_mismatch(self, batch: DataProto, metrics: Metrics) -> None:
        """The trainer-vs-rollout gap: ``rollout/log_prob_diff_*`` and the ``rollout_corr/*`` diagnostics
        (the rollout correction adds what it did to these when it runs)."""
        tensors = batch.batch
        metrics.update(
            correction_diagnostics(tensors[OLD_LOG_PROBS], tensors[ROLLOUT_LOG_PROBS], generated_mask(batch))
        )
        mismatch = log_prob_mismatch(batch)
        metrics.update(mismatch)
        self.last_log_prob_diff = mismatch.get("rollout/log_prob_diff_mean")

    def compute_advantage(self, batch: DataProto, metrics: Metrics) -> None:
        tensors, algorithm = batch.batch, self.config.algorithm
        if algorithm.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(
                tensors[TOKEN_LEVEL_SCORES],
                old_policy_log_probs(batch),
                tensors[REF_LOG_PROB],
                tensors[RESPONSE_MASK],
                self.kl_ctrl,
                algorithm.kl_penalty,
            )
            metrics.update(kl_metrics)
        else:
            rewards = tensors[TOKEN_LEVEL_SCORES]
        tensors[TOKEN_LEVEL_REWARDS] = rewards
        advantages, returns = branch_advantages(  # agent sessions with several branches: each counted once
            self.estimator,
            rewards,
            tensors[RESPONSE_MASK].float(),
            batch.non_tensor_batch[UID],
            algorithm,
            sessions=batch.non_tensor_batch.get(SESSION),
            last_branch=tensors.get(LAST_BRANCH, None),
            values=tensors.get(VALUES, None),
            reward_baselines=tensors.get(REWARD_BASELINES, None),
        )
        if TEACHER_LOG_PROB in tensors.keys():  # on-policy distillation: the teacher's per-token signal
            advantages, distill_metrics = distillation_advantages(
                advantages,
                old_policy_log_probs(batch),
                tensors[TEACHER_LOG_PROB],
                tensors[RESPONSE_MASK].float(),
                algorithm.distillation,
            )
            metrics.update(distill_metrics)
        tensors[ADVANTAGES], tensors[RETURNS] = advantages, returns


def old_policy_log_probs(batch: DataProto) -> torch.Tensor:
    """The old policy's log-probs of the sampled tokens, which KL in the reward and a teacher compare against:
    the trainer's, or the rollout's in bypass mode (old_log_prob_source=rollout)."""
    tensors = batch.batch
    return tensors[OLD_LOG_PROBS] if OLD_LOG_PROBS in tensors.keys() else tensors[ROLLOUT_LOG_PROBS]
