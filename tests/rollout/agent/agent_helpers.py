"""A request engine that answers with scripted turns (the model's outputs, fixed), and tools for the tests."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from hybridflow.rollout.agent import AgentRollout, MultiTurnConfig
from hybridflow.rollout.base import Rollout, SamplingParams
from hybridflow.rollout.requests import RequestEngine, RequestStats, TurnOutput
from hybridflow.tools import Tool, ToolResponse, ToolSet
from hybridflow.tools.calculator import CalculatorTool

EOS = "<|im_end|>"


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


class ScriptedEngine(RequestEngine):
    """Turn k of request r is ``scripts[r][k]`` (text; a turn ending in EOS stopped). Records what each turn
    was given. Log-probs are -(position + 1) / 100 over the request's generated tokens, so each is traceable."""

    def __init__(self, tokenizer, scripts: dict[int, list[str]]):
        self.tokenizer = tokenizer
        self.scripts = {
            r: [tokenizer.encode(t, add_special_tokens=False) for t in turns] for r, turns in scripts.items()
        }
        self.given: dict[int, list[list[int]]] = {}
        self.generated: dict[int, int] = {}
        self.released: set[int] = set()
        self._stats = RequestStats()

    @property
    def stats(self) -> RequestStats:
        return self._stats

    @asynccontextmanager
    async def serving(self, params: SamplingParams, *, max_len: int, max_requests: int):
        yield

    async def generate(self, request: int, new_tokens: list[int], max_new_tokens: int) -> TurnOutput:
        await asyncio.sleep(0)
        turns = self.given.setdefault(request, [])
        turns.append(list(new_tokens))
        script = self.scripts[request][len(turns) - 1]
        tokens = script[:max_new_tokens]
        start = self.generated.get(request, 0)
        self.generated[request] = start + len(tokens)
        log_probs = [-(start + i + 1) / 100 for i in range(len(tokens))]
        eos = self.tokenizer.eos_token_id
        return TurnOutput(tokens, log_probs, stopped=bool(tokens) and tokens[-1] == eos)

    def release(self, request: int) -> None:
        self.released.add(request)


class ScriptedBackend(Rollout):
    """A `Rollout` whose request engine is a ScriptedEngine (the agent rollout's backend)."""

    def __init__(self, tokenizer, scripts):
        self.engine = ScriptedEngine(tokenizer, scripts)
        self.eos_token_ids, self.pad_token_id = [tokenizer.eos_token_id], tokenizer.pad_token_id

    def request_engine(self):
        return self.engine

    def generate_sequences(self, prompts, params):
        raise AssertionError("the agent rollout must use the request engine")

    def load_weights(self, named_tensors):
        pass

    def release_cache(self):
        pass


class RecordingTool(Tool):
    """Echoes its argument; rewards each call; remembers what create/reward/release were given."""

    name = "echo"
    description = "Repeat a text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.created: dict[str, dict] = {}
        self.released: list[str] = []
        self.active = 0
        self.most_active = 0

    async def create(self, instance_id, **create_kwargs):
        self.created[instance_id] = create_kwargs

    async def execute(self, instance_id, arguments):
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        await asyncio.sleep(self.delay_s)
        self.active -= 1
        return ToolResponse(text=str(arguments["text"]), reward=0.25)

    async def reward(self, instance_id):
        return float(self.created[instance_id].get("bonus", 0.0))

    async def release(self, instance_id):
        self.released.append(instance_id)


class RaisingTool(Tool):
    name = "broken"
    description = "Always fails."
    parameters = {"type": "object", "properties": {}}

    async def execute(self, instance_id, arguments):
        raise ValueError("boom")


class HangingTool(Tool):
    name = "hang"
    description = "Never answers."
    parameters = {"type": "object", "properties": {}}

    async def execute(self, instance_id, arguments):
        await asyncio.sleep(3600)


def multi_turn_config(**changes) -> MultiTurnConfig:
    values = dict(
        enable=True,
        default_agent="tool_agent",
        tool_config_path="",
        format="hermes",
        tool_role="tool",
        max_assistant_turns=5,
        max_user_turns=5,
        max_parallel_calls=4,
        max_tool_response_length=64,
        tool_timeout_s=5.0,
    )
    return MultiTurnConfig(**(values | changes))


def scripted_rollout(tokenizer, scripts, tools=None, **config_changes):
    tools = ToolSet(tools if tools is not None else [CalculatorTool()])
    return AgentRollout(ScriptedBackend(tokenizer, scripts), tokenizer, multi_turn_config(**config_changes), tools)
