"""The driver's RL loop: the dataflow of one PPO/GRPO step, one named call per stage.

    prompts -> generate_sequences -> reward (-> more prompts: dynamic sampling) -> compute_log_prob
            -> compute_ref_log_prob -> compute_values -> KL + advantage -> loss masks and weights
            -> update_critic -> update_actor -> metrics

Every worker call returns a DataProto; the metrics it measured (the mean over its ranks) come in
its ``meta_info[METRICS]`` and are taken out by ``take_metrics``, the one way they reach a step's
metrics.

Calls to stages that do not depend on each other are issued with ``.future(...)`` and resolved
where their data is needed: on one resource pool Ray runs them in order, on different pools
(``trainer.placement``) at the same time. The step's timeline (trainer/timeline.py) records which
pool ran what when; the ``timing_s/*`` metrics come from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from hybridflow.algorithms import apply_kl_penalty, make_kl_controller
from hybridflow.algorithms.dynamic_sampling import informative_groups, rows_of_groups, select_groups
from hybridflow.algorithms.rollout_correction import correction_diagnostics, rollout_correction
from hybridflow.batch_keys import (
    ADVANTAGES,
    AGENT_NAME,
    DATA_SOURCE,
    EXTRA_INFO,
    GENERATED_MASK,
    GLOBAL_STEP,
    METRICS,
    OLD_LOG_PROBS,
    OLD_POLICY,
    PROMPT_TENSORS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RETURNS,
    REWARD_BASELINES,
    RM_SCORES,
    ROLLOUT_IS_WEIGHTS,
    ROLLOUT_LOG_PROBS,
    SAMPLING,
    SAMPLING_ROUND,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    TRUNCATED,
    UID,
    VALUES,
)
from hybridflow.data import PromptDataLoader
from hybridflow.lengths import balanced_order, packed_lengths
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.reward import RewardResult
from hybridflow.reward.shaping import apply_overlong_penalty
from hybridflow.run_files import TIMELINE_FILE
from hybridflow.trainer.checkpoint import CheckpointManager, read_trainer_state
from hybridflow.trainer.config import HybridFlowConfig
from hybridflow.trainer.metrics import (
    agent_metrics,
    data_metrics,
    generated_mask,
    log_prob_mismatch,
    throughput_metrics,
)
from hybridflow.trainer.progress import RunProgress
from hybridflow.trainer.roles import RoleGroups
from hybridflow.trainer.rollout_batches import concat_rollouts
from hybridflow.trainer.run_plan import RunPlan
from hybridflow.trainer.timeline import StepTimeline
from hybridflow.trainer.tracking import Tracking
from hybridflow.trainer.val_metrics import validation_metrics

RewardFn = Callable[[DataProto], RewardResult]


def take_metrics(output: DataProto, metrics: dict[str, float]) -> DataProto:
    """A worker group's output, with its metrics moved into ``metrics``."""
    metrics.update(output.meta_info.pop(METRICS, {}))
    return output


class RayPPOTrainer:
    generation_meta: dict = {}  # more settings for the generation calls (fully_async: the call's interrupt key)

    def __init__(
        self,
        config: HybridFlowConfig,
        plan: RunPlan,
        groups: RoleGroups,
        reward_fn: RewardFn,
        train_loader: PromptDataLoader,
        val_batches: Callable[[], Iterator[DataProto]] | None,
        tracking: Tracking,
        total_steps: int,
    ):
        self.config = config
        self.plan = plan
        self.groups = groups
        self.reward_fn = reward_fn
        self.train_loader = train_loader
        self.val_batches = val_batches
        self.tracking = tracking
        self.total_steps = total_steps
        self.estimator = plan.estimator
        self.kl_ctrl = make_kl_controller(config.algorithm.kl_ctrl)
        self.global_step = 0
        self.batches = self.train_batches()  # one iterator: dynamic sampling draws more prompts from it
        self.last_log_prob_diff: float | None = None
        self.run_dir = plan.paths.run_dir
        self.checkpoints = CheckpointManager(self.run_dir, config.trainer.max_ckpt_to_keep)
        self.timeline = StepTimeline(0)  # the current step's stages (fit gives it the progress display)

    # ---- the loop -------------------------------------------------------------------------

    def fit(self, resume_from: Path | None = None) -> dict[str, float]:
        """Train to ``total_steps``, first resuming from ``resume_from`` (a verified checkpoint) if given."""
        metrics: dict[str, float] = {}
        if not self.steps_left(resume_from):
            return metrics
        with RunProgress(self.total_steps, start_step=self.global_step) as progress:
            self.begin(progress)
            for prompts in self.batches:
                self.global_step += 1
                self.timeline = StepTimeline(self.global_step, progress)
                metrics = self.train_step(prompts)
                if self.end_step(metrics, progress):
                    break
        return metrics

    def begin(self, progress: RunProgress) -> None:
        """Step 0, before the first step: the generator made ready, validation before training when due, and
        step 0's timeline (that validation, or loading a checkpoint)."""
        self.timeline = StepTimeline(0, progress)
        self.prepare_generation()
        if self.val_batches is not None and self.config.trainer.val_before_train and self.global_step == 0:
            self.tracking.log(self.validate(), step=0)
        self.collect_spans()
        if self.global_step == 0:
            self.timeline.append_to(self.run_dir / TIMELINE_FILE)

    def prepare_generation(self) -> None:
        """Nothing to do here: the hybrid actor generates with the weights it trains (asynchronous modes give
        the rollout's pool the actor's weights)."""

    def steps_left(self, resume_from: Path | None) -> bool:
        """Resume from ``resume_from`` if given; whether any step is left to train."""
        if resume_from is not None:
            self.resume(resume_from)
        if self.global_step >= self.total_steps:
            print(f"nothing to train: the run is at step {self.global_step} of {self.total_steps}")
            return False
        return True

    def end_step(self, metrics: dict[str, float], progress: RunProgress) -> bool:
        """Validate and checkpoint when due, then record the step (metrics, timeline, progress); whether it was
        the last."""
        trainer = self.config.trainer
        last = self.global_step >= self.total_steps
        if self.val_batches is not None and (
            last or (trainer.test_freq > 0 and self.global_step % trainer.test_freq == 0)
        ):
            metrics.update(self.validate())
        if trainer.save_freq > 0 and (last or self.global_step % trainer.save_freq == 0):
            with self.timeline.stage("save_checkpoint", on_driver=True):
                self.save_checkpoint()
            metrics["timing_s/save_checkpoint"] = self.timeline.stage_seconds()["save_checkpoint"]
        self.collect_spans()
        self.timeline.append_to(self.run_dir / TIMELINE_FILE)
        self.tracking.log(metrics, step=self.global_step)
        progress.step_done(self.global_step, metrics)
        return last

    def collect_spans(self) -> None:
        """Take the spans the workers of every pool recorded since the last take into the step's timeline."""
        self.timeline.collect(self.groups)

    def train_batches(self) -> Iterator[DataProto]:
        while self.train_loader.state_dict()["epoch"] < self.config.trainer.total_epochs:
            yield from self.train_loader

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, write_more: Callable[[Path], None] | None = None) -> Path:
        """The roles' states and the driver's in a new checkpoint; ``write_more(directory)`` adds files of a
        subclass's loop (they are part of the manifest)."""

        def write_roles(directory: Path) -> None:
            self.groups.actor_rollout.save_checkpoint(str(directory))
            if self.groups.critic is not None:
                self.groups.critic.save_checkpoint(str(directory))
            if write_more is not None:
                write_more(directory)

        state = {
            "global_step": self.global_step,
            "data_loader": self.loader_state(),
            "kl_coef": self.kl_ctrl.value,
        }
        return self.checkpoints.save(self.global_step, write_roles, state)

    def loader_state(self) -> dict:
        """Where the data loader stands, for a checkpoint."""
        return self.train_loader.state_dict()

    def resume(self, checkpoint: Path) -> None:
        state = read_trainer_state(checkpoint)  # before the workers load: a bad one fails here, not in them
        self.groups.actor_rollout.load_checkpoint(str(checkpoint))
        if self.groups.critic is not None:
            self.groups.critic.load_checkpoint(str(checkpoint))
        self.global_step = state["global_step"]
        self.train_loader.load_state_dict(state["data_loader"])
        self.kl_ctrl.value = state["kl_coef"]
        print(f"resumed from {checkpoint} at step {self.global_step}")

    def train_step(self, prompts: DataProto) -> dict[str, float]:
        metrics: dict[str, float] = {}
        batch = self.experience(prompts, metrics)  # responses in rank order (scored, with dynamic sampling)
        self.learn(batch, metrics)
        self.step_metrics(batch, metrics)
        return metrics

    def learn(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """Everything of a step after generation: log-probs, values, advantages, the updates."""
        groups, timeline = self.groups, self.timeline
        # the stages that read only the responses, issued at once: where their pools differ, they run together
        after_generation = [
            self.old_log_probs(batch, metrics),
            groups.ref.compute_ref_log_prob.future(batch) if groups.ref is not None else None,
            groups.critic.compute_values.future(batch) if groups.critic is not None else None,
        ]
        if TOKEN_LEVEL_SCORES not in batch.batch.keys():
            batch.batch[TOKEN_LEVEL_SCORES] = self.score(batch, metrics, shaped=True)
        with timeline.stage("log-probs and values"):
            for output in after_generation:
                if output is not None:
                    batch.union(take_metrics(output.get(), metrics))
        if after_generation[0] is not None:
            self.measure_log_prob_mismatch(batch, metrics)
        with timeline.stage("adv", on_driver=True):
            self.compute_advantage(batch, metrics)
            self.loss_masks_and_weights(batch, metrics)
        critic_update = groups.critic.update_critic.future(batch) if groups.critic is not None else None
        if self.global_step > self.config.trainer.critic_warmup:
            with timeline.stage("update_actor"):
                self.update_actor(batch, metrics)
        if critic_update is not None:
            with timeline.stage("update_critic"):
                take_metrics(critic_update.get(), metrics)

    def step_metrics(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """What the step's data and timeline say, at its end: lengths, scores, agent turns, each stage's
        seconds and the throughput."""
        self.collect_spans()
        timings = self.timeline.stage_seconds() | {"step": time.time() - self.timeline.start}
        metrics.update(data_metrics(batch, self.config.actor_rollout_ref.rollout.response_length))
        metrics.update(agent_metrics(batch))
        metrics.update(throughput_metrics(batch, timings, self.plan.placement.processes))
        metrics["perf/driver_rss_gb"] = resident_gb()

    # ---- the stages -----------------------------------------------------------------------

    def experience(self, prompts: DataProto, metrics: dict[str, float]) -> DataProto:
        """The step's rollouts, in rank order. With dynamic sampling (``algorithm.filter_groups``) they are
        scored here: groups whose rewards are all equal are dropped and more prompts generated until the
        batch is full again."""
        dynamic = self.config.algorithm.filter_groups
        batch = self.generate(prompts, 0, metrics, scored=dynamic.enable)
        if dynamic.enable:
            batch = self.informative_batch(batch, len(prompts), metrics)
        return batch.reorder(self.rank_order(batch))

    def informative_batch(self, batch: DataProto, n_groups: int, metrics: dict[str, float]) -> DataProto:
        """``n_groups`` groups whose rewards differ, generating more rounds from the loader as needed."""
        dynamic = self.config.algorithm.filter_groups
        rounds, kept, dropped = [batch], [], []
        while True:
            informative = informative_groups(batch.non_tensor_batch[UID], batch.batch[TOKEN_LEVEL_SCORES].sum(dim=1))
            kept += [uid for uid, differs in informative.items() if differs]
            dropped += [uid for uid, differs in informative.items() if not differs]
            if len(kept) >= n_groups or not dynamic.may_generate(len(rounds)):
                break
            more = next(self.batches, None)
            if more is None:  # the data ran out
                break
            batch = self.generate(more, len(rounds), {}, scored=True)
            rounds.append(batch)
        whole = concat_rollouts(rounds, self.train_loader.dataset.tokenizer.pad_token_id)
        chosen, filler = select_groups(kept, dropped, n_groups)
        metrics.update(
            {
                "dynamic_sampling/gen_rounds": len(rounds),
                "dynamic_sampling/informative_groups": len(kept),
                "dynamic_sampling/dropped_groups": len(dropped),
                "dynamic_sampling/filler_groups": filler,
            }
        )
        if filler:
            print(
                f"step {self.global_step}: {filler} of {n_groups} groups have equal rewards after {len(rounds)} "
                "generation rounds (algorithm.filter_groups.max_num_gen_batches); trained on as filler"
            )
        return whole[rows_of_groups(whole.non_tensor_batch[UID], chosen)]

    def generate(self, prompts: DataProto, round_index: int, metrics: dict[str, float], scored: bool) -> DataProto:
        """One generation round: rollouts of ``prompts`` (and ReMax's greedy baseline), scored if asked."""
        with self.timeline.stage("gen"):
            batch = self.rollout(prompts, "train", metrics, round_index)
            if self.estimator.needs_baseline:
                batch.batch[REWARD_BASELINES] = self.greedy_baseline(prompts, round_index)
        if scored:
            batch.batch[TOKEN_LEVEL_SCORES] = self.score(batch, metrics, shaped=True)
        return batch

    def rollout(self, prompts: DataProto, sampling: str, metrics: dict[str, float], round_index: int = 0) -> DataProto:
        """n responses per prompt, with a group id (uid) shared by the samples of one prompt.

        ``sampling``: "train" (rollout.n samples, training settings), "validate" (val_kwargs), "greedy" (1 greedy).
        ``round_index``: the step's generation round (dynamic sampling), for distinct uids and seeds.
        """
        rollout_config = self.config.actor_rollout_ref.rollout
        n = {"train": rollout_config.n, "validate": rollout_config.val_kwargs.n, "greedy": 1}[sampling]
        prefix = f"{self.global_step}" if round_index == 0 else f"{self.global_step}.{round_index}"
        prompts.non_tensor_batch[UID] = np.array([f"{prefix}-{i}" for i in range(len(prompts))], dtype=object)
        gen_input = prompts.pop(batch_keys=list(PROMPT_TENSORS))
        if rollout_config.multi_turn.enable:  # each row's agent loop and its tools' arguments
            gen_input.union(prompts.select(batch_keys=[], non_tensor_batch_keys=[AGENT_NAME, EXTRA_INFO]))
        gen_input.meta_info = {GLOBAL_STEP: self.global_step, SAMPLING: sampling, SAMPLING_ROUND: round_index}
        gen_input.meta_info.update(self.generation_meta)
        generated = take_metrics(
            self.groups.generator.generate_sequences(gen_input.repeat(n, interleave=True)), metrics
        )
        batch = prompts.repeat(n, interleave=True).union(generated)
        batch.batch[GENERATED_MASK] = batch.batch[RESPONSE_MASK].clone()  # before any loss mask narrows it
        batch.meta_info = {GLOBAL_STEP: self.global_step}
        return batch

    def rank_order(self, batch: DataProto) -> list[int]:
        """Rows reordered so that every data-parallel rank of the actor's training layout gets about as
        many tokens to compute, with the samples of one prompt on one rank (packing computes their prompt
        once)."""
        ranks = self.plan.actor_layout.dp
        return balanced_order(packed_lengths(batch), ranks, groups=list(batch.non_tensor_batch[UID]))

    def old_log_probs(self, batch: DataProto, metrics: dict[str, float]) -> DataProtoFuture | None:
        """The trainer's log-probs of the sampled tokens (a pending pass), or None where the update supplies
        the old policy: the generator's log-probs when configured (and, for auto, close), or its own."""
        rollout = self.config.actor_rollout_ref.rollout
        use_rollout = rollout.old_log_prob_source == "rollout" or (
            rollout.old_log_prob_source == "auto"
            and self.last_log_prob_diff is not None
            and self.last_log_prob_diff < rollout.log_prob_tolerance
            and self.global_step % rollout.log_prob_check_every != 0
        )
        metrics["rollout/used_rollout_log_probs"] = float(use_rollout)
        batch.meta_info[OLD_POLICY] = "rollout" if use_rollout else "trainer"
        if use_rollout or self.plan.on_policy_update:
            return None  # the update takes its old policy as configured, and returns the trainer's log-probs
        return self.groups.actor_rollout.compute_log_prob.future(batch)

    def loss_masks_and_weights(self, batch: DataProto, metrics: dict[str, float]) -> None:
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

    def update_actor(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """The policy update; without old log-probs (an on-policy step, or the rollout's as the old
        policy), it returns the trainer's log-probs of each row's first forward (and entropy), for the metrics."""
        computed_old_log_probs = OLD_LOG_PROBS not in batch.batch.keys()
        batch.union(take_metrics(self.groups.actor_rollout.update_actor(batch), metrics))
        if computed_old_log_probs:
            self.measure_log_prob_mismatch(batch, metrics)

    def measure_log_prob_mismatch(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """The trainer-vs-rollout gap: ``rollout/log_prob_diff_*`` and the ``rollout_corr/*`` diagnostics
        (the rollout correction adds what it did to these when it runs)."""
        tensors = batch.batch
        metrics.update(
            correction_diagnostics(tensors[OLD_LOG_PROBS], tensors[ROLLOUT_LOG_PROBS], generated_mask(batch))
        )
        mismatch = log_prob_mismatch(batch)
        metrics.update(mismatch)
        self.last_log_prob_diff = mismatch.get("rollout/log_prob_diff_mean")

    def greedy_baseline(self, prompts: DataProto, round_index: int) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt, repeated over its n samples."""
        greedy = self.rollout(prompts.select(deepcopy=True), "greedy", {}, round_index)
        scores = self.score(greedy, {}, shaped=True).sum(dim=1)
        return scores.repeat_interleave(self.config.actor_rollout_ref.rollout.n)

    def score(self, batch: DataProto, metrics: dict[str, float], shaped: bool) -> torch.Tensor:
        """Token-level scores (B, R): rule-based or custom reward, plus the reward model's when enabled;
        ``shaped`` (training rewards, not validation): plus the overlong penalty on the last token."""
        reward_model = self.groups.reward_model
        rm_scores = reward_model.compute_rm_score.future(batch) if reward_model is not None else None
        with self.timeline.stage("reward", on_driver=True):  # the rule-based reward, while the reward model scores
            result = self.reward_fn(batch)
        metrics.update(result.metrics)
        scores = result.token_level_scores
        if rm_scores is not None:
            scores = scores + rm_scores.get().batch[RM_SCORES]
        overlong = self.config.reward.overlong_buffer
        if shaped and overlong.enable:
            scores, shaping_metrics = apply_overlong_penalty(scores, batch.batch[RESPONSE_MASK], overlong)
            metrics.update(shaping_metrics)
        return scores

    def compute_advantage(self, batch: DataProto, metrics: dict[str, float]) -> None:
        tensors, algorithm = batch.batch, self.config.algorithm
        if algorithm.use_kl_in_reward:
            # the old policy's log-probs: the trainer's, or the rollout's in bypass mode
            old_policy = tensors[OLD_LOG_PROBS] if OLD_LOG_PROBS in tensors.keys() else tensors[ROLLOUT_LOG_PROBS]
            rewards, kl_metrics = apply_kl_penalty(
                tensors[TOKEN_LEVEL_SCORES],
                old_policy,
                tensors[REF_LOG_PROB],
                tensors[RESPONSE_MASK],
                self.kl_ctrl,
                algorithm.kl_penalty,
            )
            metrics.update(kl_metrics)
        else:
            rewards = tensors[TOKEN_LEVEL_SCORES]
        tensors[TOKEN_LEVEL_REWARDS] = rewards
        advantages, returns = self.estimator(
            rewards,
            tensors[RESPONSE_MASK].float(),
            batch.non_tensor_batch[UID],
            algorithm,
            values=tensors.get(VALUES, None),
            reward_baselines=tensors.get(REWARD_BASELINES, None),
        )
        tensors[ADVANTAGES], tensors[RETURNS] = advantages, returns

    def validate(self) -> dict[str, float]:
        """Mean score per data source on the held-out prompts, with the validation sampling settings."""
        sources, uids, scores = [], [], []
        with self.timeline.stage("validate", on_driver=True):
            for index, prompts in enumerate(self.val_batches()):
                batch = self.rollout(prompts, "validate", {})
                sources += list(batch.non_tensor_batch[DATA_SOURCE])
                uids += [f"{index}/{uid}" for uid in batch.non_tensor_batch[UID]]
                scores += self.score(batch, {}, shaped=False).sum(dim=1).tolist()
        return validation_metrics(sources, uids, scores, n=self.config.actor_rollout_ref.rollout.val_kwargs.n)
