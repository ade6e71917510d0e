"""The generating side of an RL step: prompts -> n responses each, scored, in the order the actor's ranks take them.

    prompts -> generate_sequences on the generator's pool (-> ReMax's greedy baseline) -> reward
            (-> dynamic sampling: drop the groups whose rewards are all equal, generate more rounds) -> rank order

``Generation`` holds no step of its own: every call says which step it generates for and on which timeline it
is timed, so the same object serves a step generated now (``sync``), one step ahead in a thread
(``one_step_off``) and the fully asynchronous rollouter's chunks, each with exactly what it needs.
``Scorer`` is the reward: the rule-based or custom function, plus the reward model's scores, shaped for training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass

import numpy as np
import torch

from hybridflow.algorithms.advantage import AdvantageEstimator
from hybridflow.algorithms.dynamic_sampling import informative_groups, rows_of_groups, select_groups
from hybridflow.batch_keys import (
    AGENT_BRANCH_ROWS,
    AGENT_NAME,
    EXTRA_INFO,
    GENERATED_MASK,
    GLOBAL_STEP,
    METRICS,
    PROMPT_TENSORS,
    RECORD_ROUTES,
    RESPONSE_MASK,
    REWARD_BASELINES,
    RM_SCORES,
    SAMPLING,
    SAMPLING_ROUND,
    TOKEN_LEVEL_SCORES,
    UID,
)
from hybridflow.controller import RayWorkerGroup
from hybridflow.lengths import balanced_order, packed_lengths
from hybridflow.protocol import DataProto
from hybridflow.reward import RewardResult
from hybridflow.reward.shaping import apply_overlong_penalty
from hybridflow.rollout.agent_server.branch_rows import expand_branches
from hybridflow.rollout.agent_server.rollout import ROW_COLUMNS
from hybridflow.trainer.asynchronous.rollout_batches import concat_rollouts
from hybridflow.trainer.loop.step_loop import Metrics
from hybridflow.trainer.services.timeline import StepTimeline
from hybridflow.trainer.setup.config import HybridFlowConfig

RewardFn = Callable[[DataProto], RewardResult]


def take_metrics(output: DataProto, metrics: Metrics) -> DataProto:
    """A worker group's output, with its metrics (the mean over its ranks) moved into ``metrics``."""
    metrics.update(output.meta_info.pop(METRICS, {}))
    return output


def rank_order(batch: DataProto, ranks: int) -> list[int]:
    """Rows reordered so that every data-parallel rank of the actor's training layout gets about as many tokens
    to compute, with the samples of one prompt on one rank (packing computes their prompt once)."""
    return balanced_order(packed_lengths(batch), ranks, groups=list(batch.non_tensor_batch[UID]))


def mark_generated(batch: DataProto, step: int) -> DataProto:
    """A generated batch of ``step``, its generated tokens' mask kept before any loss mask narrows the response's."""
    batch.batch[GENERATED_MASK] = batch.batch[RESPONSE_MASK].clone()
    batch.meta_info = {GLOBAL_STEP: step}
    return batch


def informative_uids(batch: DataProto) -> dict[str, bool]:
    """Dynamic sampling's test, per group (uid) of a scored batch: whether its samples' rewards differ."""
    return informative_groups(batch.non_tensor_batch[UID], batch.batch[TOKEN_LEVEL_SCORES].sum(dim=1))


class Scorer:
    """Token-level scores of responses: the reward function's, plus the reward model's when the run has one."""

    def __init__(self, config: HybridFlowConfig, reward_fn: RewardFn, reward_model: RayWorkerGroup | None):
        self.reward_fn = reward_fn
        self.reward_model = reward_model
        self.replace_rule = config.reward_model.replace_rule_reward
        self.overlong = config.reward.overlong_buffer

    def __call__(self, batch: DataProto, metrics: Metrics, timeline: StepTimeline, *, shaped: bool) -> torch.Tensor:
        """(B, R) scores; ``shaped`` (training rewards, not validation's): plus the overlong penalty on the last
        token. With ``reward_model.replace_rule_reward`` training scores are the reward model's alone (the rule's
        mean logged as ``reward/rule_score``) and validation's the rule's alone."""
        use_model = self.reward_model is not None and (shaped or not self.replace_rule)
        rm_scores = self.reward_model.compute_rm_score.future(batch) if use_model else None
        with timeline.stage("reward", on_driver=True):  # the rule-based reward, while the reward model scores
            result = self.reward_fn(batch)
        metrics.update(result.metrics)
        scores = result.token_level_scores
        if rm_scores is not None:
            model_scores = rm_scores.get().batch[RM_SCORES]
            if self.replace_rule:
                metrics["reward/rule_score"] = float(scores.sum(dim=1).mean())
                scores = model_scores
            else:
                scores = scores + model_scores
        if shaped and self.overlong.enable:
            scores, shaping_metrics = apply_overlong_penalty(scores, batch.batch[RESPONSE_MASK], self.overlong)
            metrics.update(shaping_metrics)
        return scores


@dataclass
class Generation:
    """Rollouts of prompts on ``generator`` (the hybrid actor, or the rollout role's pool), scored by ``score``."""

    config: HybridFlowConfig
    generator: RayWorkerGroup
    score: Scorer
    estimator: AdvantageEstimator
    _: KW_ONLY
    pad_token_id: int
    actor_ranks: int  # the actor's data-parallel ranks in training, which the batch's order serves

    def experience(
        self, prompts: DataProto, more_prompts: Iterator[DataProto], step: int, timeline: StepTimeline, metrics: Metrics
    ) -> DataProto:
        """Step ``step``'s rollouts, in rank order. With dynamic sampling (``algorithm.filter_groups``) they are
        scored here: groups whose rewards are all equal are dropped and more prompts (from ``more_prompts``)
        generated until the batch is full again."""
        dynamic = self.config.algorithm.filter_groups
        batch = self.generate(prompts, step, timeline, metrics, scored=dynamic.enable)
        if dynamic.enable:
            batch = self.informative_batch(batch, len(prompts), more_prompts, step, timeline, metrics)
        return batch.reorder(rank_order(batch, self.actor_ranks))

    def informative_batch(
        self,
        batch: DataProto,
        n_groups: int,
        more_prompts: Iterator[DataProto],
        step: int,
        timeline: StepTimeline,
        metrics: Metrics,
    ) -> DataProto:
        """``n_groups`` groups whose rewards differ, generating more rounds from ``more_prompts`` as needed."""
        dynamic = self.config.algorithm.filter_groups
        rounds, kept, dropped = [batch], [], []
        while True:
            informative = informative_uids(batch)
            kept += [uid for uid, differs in informative.items() if differs]
            dropped += [uid for uid, differs in informative.items() if not differs]
            if len(kept) >= n_groups or not dynamic.may_generate(len(rounds)):
                break
            more = next(more_prompts, None)
            if more is None:  # the data ran out
                break
            batch = self.generate(more, step, timeline, {}, scored=True, round_index=len(rounds))
            rounds.append(batch)
        whole = concat_rollouts(rounds, self.pad_token_id)
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
                f"step {step}: {filler} of {n_groups} groups have equal rewards after {len(rounds)} "
                "generation rounds (algorithm.filter_groups.max_num_gen_batches); trained on as filler"
            )
        return whole[rows_of_groups(whole.non_tensor_batch[UID], chosen)]

    def generate(
        self,
        prompts: DataProto,
        step: int,
        timeline: StepTimeline,
        metrics: Metrics,
        *,
        scored: bool,
        round_index: int = 0,
        meta: dict | None = None,
    ) -> DataProto:
        """One generation round: rollouts of ``prompts`` (and ReMax's greedy baseline), scored if asked.
        ``meta``: more settings for the generation call (fully_async: the call's interrupt key)."""
        with timeline.stage("gen"):
            batch = self.rollout(prompts, "train", step, metrics, round_index, meta)
            if self.estimator.needs_baseline:
                batch.batch[REWARD_BASELINES] = self.greedy_baseline(prompts, step, timeline, round_index)
            batch = expand_branches(batch)  # agent sessions' other branches: rows of their groups, trained too
        if scored:
            batch.batch[TOKEN_LEVEL_SCORES] = self.score(batch, metrics, timeline, shaped=True)
        return batch

    def rollout(
        self,
        prompts: DataProto,
        sampling: str,
        step: int,
        metrics: Metrics,
        round_index: int = 0,
        meta: dict | None = None,
    ) -> DataProto:
        """n responses per prompt, with a group id (uid) shared by the samples of one prompt.

        ``sampling``: "train" (rollout.n samples, training settings), "validate" (val_kwargs), "greedy" (1 greedy).
        ``round_index``: the step's generation round (dynamic sampling), for distinct uids and seeds.
        """
        rollout_config = self.config.actor_rollout_ref.rollout
        n = {"train": rollout_config.n, "validate": rollout_config.val_kwargs.n, "greedy": 1}[sampling]
        prefix = f"{step}" if round_index == 0 else f"{step}.{round_index}"
        prompts.non_tensor_batch[UID] = np.array([f"{prefix}-{i}" for i in range(len(prompts))], dtype=object)
        gen_input = prompts.pop(batch_keys=list(PROMPT_TENSORS))
        if rollout_config.multi_turn.enable:  # each row's agent loop and its tools' arguments
            gen_input.union(prompts.select(batch_keys=[], non_tensor_batch_keys=[AGENT_NAME, EXTRA_INFO]))
        if rollout_config.agent.enabled:  # what the user's agent is given of its row
            present = [key for key in ROW_COLUMNS if key in prompts.non_tensor_batch]
            gen_input.union(prompts.select(batch_keys=[], non_tensor_batch_keys=present, deepcopy=True))
        request = gen_input.repeat(n, interleave=True)
        generated = self.call(request, step, metrics, sampling=sampling, round_index=round_index, meta=meta)
        if sampling != "train":  # sessions' other branches are trained, not validated: the last is the answer
            generated.non_tensor_batch.pop(AGENT_BRANCH_ROWS, None)
        return mark_generated(prompts.repeat(n, interleave=True).union(generated), step)

    def call(
        self,
        request: DataProto,
        step: int,
        metrics: Metrics,
        *,
        sampling: str = "train",
        round_index: int = 0,
        meta: dict | None = None,
    ) -> DataProto:
        """One ``generate_sequences`` call for ``step`` (new prompts, or samples to continue): its settings in the
        request's meta_info, the generator's metrics moved into ``metrics``."""
        record = sampling == "train" and self.config.actor_rollout_ref.actor.router_replay.rollout_records
        request.meta_info = {GLOBAL_STEP: step, SAMPLING: sampling, SAMPLING_ROUND: round_index, RECORD_ROUTES: record}
        request.meta_info |= meta or {}
        return take_metrics(self.generator.generate_sequences(request), metrics)

    def greedy_baseline(self, prompts: DataProto, step: int, timeline: StepTimeline, round_index: int) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt, repeated over its n samples."""
        greedy = self.rollout(prompts.select(deepcopy=True), "greedy", step, {}, round_index)
        scores = self.score(greedy, {}, timeline, shaped=True).sum(dim=1)
        return scores.repeat_interleave(self.config.actor_rollout_ref.rollout.n)
