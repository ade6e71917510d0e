"""One-step-off-policy training: the rollout role generates the next batch while the actor trains on this one.

The synchronous loop (ppo_trainer.py) generates, then trains, on the actor's pool. Here generation runs on
the rollout role's own pool, one batch ahead:

    step k:   B(k+1) generated with the weights w(k-1)   |   the actor trains w(k-1) -> w(k) on B(k)
              then the new weights w(k) go to the rollout's ranks (hybrid_engine/pool_transfer.py)

so each batch is trained one policy version after the one that generated it (B(1) and B(2) both come from
w(0)). The loss corrects for that lag with the decoupled objective: PPO's clipping against the trainer's
recomputed log-probs (the proximal policy) and per-token importance weights between those and the
rollout's (the behaviour policy), truncated or masked: ``algorithm.rollout_correction``; or, cheaper, the
rollout's log-probs as the old policy (``old_log_prob_source=rollout``). check_config requires one of them.

Validation uses the newest weights (after the transfer that follows the step). A checkpoint after step k
holds w(k) and the already generated B(k+1), so a resumed run trains on exactly what an uninterrupted one
would: the loop is deterministic.

The next batch is made on a copy of the trainer one step ahead (its own step number and timeline, the same
worker groups, data and reward), in one background thread: the driver's stages for it (reward scoring for
dynamic sampling, ReMax's baseline) overlap the training stages like the workers' do.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.progress import RunProgress
from hybridflow.trainer.timeline import StepTimeline
from hybridflow.trainer.weight_link import link_actor_to_rollout

PENDING_BATCH = "pending_batch.pkl"  # in a checkpoint: the batch generated for the step after it


class Experience:
    """One batch being generated in the background: its future, and what its generation recorded (metrics;
    the driver's spans, on the copy's timeline)."""

    def __init__(self, future: Future[DataProto], timeline: StepTimeline, metrics: dict[str, float]):
        self.future = future
        self.timeline = timeline
        self.metrics = metrics

    @classmethod
    def done(cls, step: int, batch: DataProto, metrics: dict[str, float]) -> Experience:
        """A batch generated earlier (restored from a checkpoint)."""
        future: Future[DataProto] = Future()
        future.set_result(batch)
        return cls(future, StepTimeline(step), metrics)


class OneStepOffTrainer(RayPPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.link = link_actor_to_rollout(self.groups, self.plan, self.config.trainer.async_training)
        self.generating = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate-ahead")
        self.pending: Experience | None = None  # the next step's batch: being generated, done, or restored

    # ---- the loop -------------------------------------------------------------------------

    def prepare_generation(self) -> None:
        """The rollout's pool starts from the actor's weights (those of a checkpoint)."""
        self.link.connect()
        self.transfer_weights({})

    def fit(self, resume_from: Path | None = None) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if not self.steps_left(resume_from):
            return metrics
        try:
            with RunProgress(self.total_steps, start_step=self.global_step) as progress:
                self.begin(progress)
                while True:
                    self.timeline = StepTimeline(self.global_step + 1, progress)
                    batch, metrics = self.next_batch()  # generated during the last step (or now, at first)
                    if batch is None:  # the data ran out
                        break
                    self.global_step += 1
                    if self.global_step < self.total_steps:
                        self.pending = self.generate_ahead(self.global_step + 1)
                    self.learn(batch, metrics)
                    self.finish_generation(metrics)
                    self.transfer_weights(metrics)
                    self.step_metrics(batch, metrics)  # the step's time: until the next batch and weights are ready
                    if self.end_step(metrics, progress):
                        break
        except BaseException:
            self.stop_generation()  # a worker failed (or the user stopped the run): generation stops with it
            raise
        self.generating.shutdown(wait=True)
        return metrics

    def stop_generation(self, timeout_s: float = 60.0) -> None:
        """End the generation running in the background before the Ray session ends: every pool's processes
        are killed, so the thread's waiting call returns with their error, and the thread is joined. A
        thread left inside a Ray call while the session shuts down can take the driver's whole process with
        it (seen once: the next test's cluster start ended pytest with exit 1 and no report)."""
        self.generating.shutdown(wait=False, cancel_futures=True)
        if self.pending is not None and not self.pending.future.done():  # the one batch that can be running
            for group in self.groups.by_pool().values():
                with contextlib.suppress(Exception):  # already dead, or Ray already gone
                    group.kill()
            done, _ = futures.wait([self.pending.future], timeout=timeout_s)
            if not done:
                print(f"warning: the background generation did not stop within {timeout_s:.0f} s of its pools' end")
                return
        self.generating.shutdown(wait=True)  # its thread ends after the last item

    def next_batch(self) -> tuple[DataProto | None, dict[str, float]]:
        """The batch of step global_step + 1 and its generation's metrics: generated during the last step,
        restored from the checkpoint, or (the run's first step) generated now."""
        if self.pending is None:
            self.pending = self.generate_ahead(self.global_step + 1)
            if self.pending is not None:
                with self.timeline.stage("gen"):
                    self.pending.future.result()
                self.timeline.absorb(self.pending.timeline)
        experience, self.pending = self.pending, None
        if experience is None:
            return None, {}
        return experience.future.result(), dict(experience.metrics)

    def generate_ahead(self, step: int) -> Experience | None:
        """Start generating the batch of ``step`` on the rollout's pool (None when the data ran out)."""
        prompts = next(self.batches, None)
        if prompts is None:
            return None
        ahead = copy.copy(self)  # the trainer one step ahead: its own step and timeline, everything else shared
        ahead.global_step, ahead.timeline, metrics = step, StepTimeline(step), {}
        future = self.generating.submit(ahead.experience, prompts, metrics)
        return Experience(future, ahead.timeline, metrics)

    def finish_generation(self, metrics: dict[str, float]) -> None:
        """Wait for the next step's batch (the trainer's wait: how much longer generation took than the
        step's training), and take in what its generation recorded on the driver."""
        if self.pending is None:
            return
        start = time.time()
        with self.timeline.stage("wait for generation"):
            self.pending.future.result()  # a worker's error surfaces here, named
        metrics["async/trainer_wait_s"] = time.time() - start
        self.timeline.absorb(self.pending.timeline)
        self.collect_spans()  # the generation's spans so far: how long the rollout's ranks were busy
        busy = self.timeline.stage_seconds().get("gen", 0.0)
        metrics["async/rollout_idle_s"] = max(0.0, time.time() - self.timeline.start - busy)

    def transfer_weights(self, metrics: dict[str, float]) -> None:
        """The actor's weights of global_step to the rollout's ranks (both pools idle meanwhile)."""
        with self.timeline.stage("weight_transfer", on_driver=True):
            metrics.update(self.link.send(version=self.global_step))

    # ---- what one step reports -------------------------------------------------------------

    def learn(self, batch: DataProto, metrics: dict[str, float]) -> None:
        generated_by = metrics.get("rollout/weights_version")
        super().learn(batch, metrics)
        if generated_by is not None:  # the policy the batch trains: global_step - 1
            metrics["async/policy_version_lag"] = self.global_step - 1 - generated_by

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, write_more=None) -> Path:
        """The step's state and the already generated batch of the next step, with its generation's metrics
        (none after the last step)."""
        pending = self.pending

        def write_pending(directory: Path) -> None:
            if pending is not None:
                record = {"batch": pending.future.result(), "metrics": pending.metrics}
                (directory / PENDING_BATCH).write_bytes(pickle.dumps(record))

        return super().save_checkpoint(write_pending)

    def resume(self, checkpoint: Path) -> None:
        super().resume(checkpoint)
        pending = checkpoint / PENDING_BATCH
        if pending.is_file():
            record = pickle.loads(pending.read_bytes())
            self.pending = Experience.done(self.global_step + 1, record["batch"], record["metrics"])
        elif self.global_step < self.total_steps:
            print(f"{checkpoint} holds no generated batch (a synchronous run's): the next one is generated anew")
