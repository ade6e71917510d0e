"""one_step_off's batches: the rollout role generates the next batch while the actor trains on this one.

    step k:   B(k+1) generated with the weights w(k-1)   |   the actor trains w(k-1) -> w(k) on B(k)
              then the new weights w(k) go to the rollout's ranks (weight_sync.TransferEachStep)

so each batch is trained one policy version after the one that generated it (B(1) and B(2) both come from
w(0)). The loss corrects for that lag with the decoupled objective: PPO's clipping against the trainer's
recomputed log-probs (the proximal policy) and per-token importance weights between those and the
rollout's (the behaviour policy), truncated or masked: ``algorithm.rollout_correction``; or, cheaper, the
rollout's log-probs as the old policy (``old_log_prob_source=rollout``). check_config requires one of them.

A checkpoint after step k holds w(k) and the already generated B(k+1), so a resumed run trains on exactly what
an uninterrupted one would: the loop is deterministic.

The next batch is generated in one background thread, given exactly what it needs (its prompts, its step
number, a timeline of its own, the prompt iterator for dynamic sampling's further rounds): the driver's stages
for it (reward scoring for dynamic sampling, ReMax's baseline) overlap the training stages like the workers' do.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hybridflow.data import PromptDataLoader
from hybridflow.protocol import DataProto
from hybridflow.trainer.loop.batch_source import BatchSource, train_batches
from hybridflow.trainer.loop.generation import Generation, Metrics
from hybridflow.trainer.services.timeline import StepTimeline
from hybridflow.trainer.setup.roles import RoleGroups

PENDING_BATCH = "pending_batch.pkl"  # in a checkpoint: the batch generated for the step after it


@dataclass
class Experience:
    """One batch being generated in the background: its future, and what its generation recorded (metrics; the
    driver's spans, on its own timeline)."""

    future: Future[DataProto]
    timeline: StepTimeline
    metrics: Metrics

    @classmethod
    def done(cls, step: int, batch: DataProto, metrics: Metrics) -> Experience:
        """A batch generated earlier (restored from a checkpoint)."""
        future: Future[DataProto] = Future()
        future.set_result(batch)
        return cls(future, StepTimeline(step), metrics)


class GenerateAhead(BatchSource):
    def __init__(
        self,
        generation: Generation,
        groups: RoleGroups,
        loader: PromptDataLoader,
        *,
        total_epochs: int,
        total_steps: int,
    ):
        super().__init__(generation, groups, loader)
        self.total_steps = total_steps
        self.batches: Iterator[DataProto] = train_batches(loader, total_epochs)
        self.generating = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate-ahead")
        self.pending: Experience | None = None  # the next step's batch: being generated, done, or restored

    def next(self, step: int, timeline: StepTimeline) -> tuple[DataProto, Metrics] | None:
        """The batch generated during the last step (restored from the checkpoint, or at the run's first step
        generated now); the next step's starts generating."""
        if self.pending is None:
            self.pending = self.generate(step)
            if self.pending is not None:
                with timeline.stage("gen"):
                    self.pending.future.result()
                timeline.absorb(self.pending.timeline)
        experience, self.pending = self.pending, None
        if experience is None:  # the data ran out
            return None
        batch, metrics = experience.future.result(), dict(experience.metrics)
        if step < self.total_steps:
            self.pending = self.generate(step + 1)
        generated_by = metrics.get("rollout/weights_version")
        if generated_by is not None:  # the policy the batch trains: step - 1
            metrics["async/policy_version_lag"] = step - 1 - generated_by
        return batch, metrics

    def generate(self, step: int) -> Experience | None:
        """Start generating the batch of ``step`` on the rollout's pool (None when the data ran out)."""
        prompts = next(self.batches, None)
        if prompts is None:
            return None
        timeline, metrics = StepTimeline(step), {}
        future = self.generating.submit(self.generation.experience, prompts, self.batches, step, timeline, metrics)
        return Experience(future, timeline, metrics)

    def after_learn(self, step: int, timeline: StepTimeline, metrics: Metrics) -> None:
        """Wait for the next step's batch (the trainer's wait: how much longer generation took than the step's
        training), and take in what its generation recorded on the driver: the weights move next, with both
        pools idle."""
        if self.pending is None:
            return
        start = time.time()
        with timeline.stage("wait for generation"):
            self.pending.future.result()  # a worker's error surfaces here, named
        metrics["async/trainer_wait_s"] = time.time() - start
        timeline.absorb(self.pending.timeline)
        timeline.collect(self.groups)  # the generation's spans so far: how long the rollout's ranks were busy
        busy = timeline.stage_seconds().get("gen", 0.0)
        metrics["async/rollout_idle_s"] = max(0.0, time.time() - timeline.start - busy)

    def checkpoint(self) -> tuple[dict, list[tuple[str, bytes]]]:
        """The loader's position and the already generated batch of the next step with its generation's metrics
        (none after the last step)."""
        if self.pending is None:
            return self.loader.state_dict(), []
        record = {"batch": self.pending.future.result(), "metrics": self.pending.metrics}
        return self.loader.state_dict(), [(PENDING_BATCH, pickle.dumps(record))]

    def restore(self, checkpoint: Path, step: int) -> None:
        pending = checkpoint / PENDING_BATCH
        if pending.is_file():
            record = pickle.loads(pending.read_bytes())
            self.pending = Experience.done(step + 1, record["batch"], record["metrics"])
        elif step < self.total_steps:
            print(f"{checkpoint} holds no generated batch (a synchronous run's): the next one is generated anew")

    def end(self, failed: bool) -> None:
        """After the last step the thread ends after its last item. After a failure (a worker died, the user
        stopped the run) the generation running in the background ends before the Ray session does: every
        pool's processes are killed, so the thread's waiting call returns with their error, and the thread is
        joined. A thread left inside a Ray call while the session shuts down can take the driver's whole
        process with it (seen once: the next test's cluster start ended pytest with exit 1 and no report)."""
        if not failed:
            self.generating.shutdown(wait=True)
            return
        timeout_s = 60.0
        self.generating.shutdown(wait=False, cancel_futures=True)
        if self.pending is not None and not self.pending.future.done():  # the one batch that can be running
            self.groups.kill()
            done, _ = futures.wait([self.pending.future], timeout=timeout_s)
            if not done:
                print(f"warning: the background generation did not stop within {timeout_s:.0f} s of its pools' end")
                return
        self.generating.shutdown(wait=True)
