"""A two-turn verifiers environment on a reasoning-gym task: the model answers, the environment asks it to check
its answer, the model answers again, and reasoning-gym's score_answer scores the second reply. Taskset id
``reasoning_gym_recheck`` (settings as reasoning_gym_single's). Both replies are trained; the environment's message
between them is not (its tokens are masked)."""

import verifiers.v1 as vf
from reasoning_gym_single import RGTaskset

RECHECK = "Check your answer. Reply with the final answer only."


class RecheckTaskset(RGTaskset):
    pass


class RecheckEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "hybridflow-chat"}, runtime=vf.SubprocessConfig())


class RecheckEnv(vf.Env[RecheckEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()  # the task's prompt: the model speaks first
            if not first.terminated:
                await chat.turn(RECHECK)


__all__ = ["RecheckTaskset", "RecheckEnv"]
