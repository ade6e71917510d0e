"""A verifiers taskset of one reasoning-gym task, single-turn: the model answers the question once and
reasoning-gym's own score_answer scores the reply. Taskset id ``reasoning_gym_single``; its settings
(rollout.agent.verifiers.args.taskset): ``dataset`` (a reasoning-gym task name), ``settings`` (that task's config),
``size`` and ``seed``.

    actor_rollout_ref.rollout.agent.verifiers:
      env: reasoning_gym_single
      path: examples/environments
      args: {taskset: {dataset: chain_sum, settings: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}}
"""

import reasoning_gym
import verifiers.v1 as vf
from reasoning_gym.utils import extract_answer

ANSWER_FORMAT = "\n\nGive only the final answer, nothing else."


def reply_answer(reply: str) -> str:
    """The answer in a reply: the last <answer> pair's text, or the whole reply without a final period."""
    tagged = extract_answer(reply)
    return tagged if tagged is not None else reply.strip().removesuffix(".")


class RGData(vf.TaskData):
    entry: int  # the entry's index in the reasoning-gym dataset


class RGTask(vf.Task[RGData]):
    @vf.reward(weight=1.0)
    async def answer_score(self, trace: vf.Trace) -> float:
        dataset = self.config_dataset
        return float(dataset.score_answer(reply_answer(trace.last_reply), dataset[self.data.entry]))


class RGConfig(vf.TasksetConfig):
    dataset: str = "chain_sum"
    settings: dict = {}
    size: int = 1000
    seed: int = 0


class RGTaskset(vf.Taskset[RGTask, RGConfig]):
    def load(self):
        config = self.config
        dataset = reasoning_gym.create_dataset(config.dataset, seed=config.seed, size=config.size, **config.settings)
        for index in range(config.size):
            task = RGTask(RGData(prompt=dataset[index]["question"] + ANSWER_FORMAT, entry=index), config.task)
            task.config_dataset = dataset
            yield task


__all__ = ["RGTaskset"]
