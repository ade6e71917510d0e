"""The agent endpoint's overhead: the calculator workload through the OpenAI-compatible endpoint (an openai-SDK
agent per sample, HTTP on loopback) against the in-process `tool_agent` loop, on the same engine, in one run (run by
hand, not a test).

    .venv/bin/python bench/agent_server.py                   # smollm2, native engine, 32 samples, 3 repeats
    .venv/bin/python bench/agent_server.py --requests 64 --repeats 5

Both sides see the same conversations: the prompt is the calculator task's chat (system message, worked example,
question) with the calculator described in the endpoint's fallback tools format (rendered once, given to the
in-process loop as its prompt tokens), greedy decoding, the same calculator answering each first call of a turn
(later calls of a turn get the in-process loop's error text), at most 4 assistant turns. A turn whose tool-call
markup does not parse ends the conversation through the endpoint (the agent reads text) but is answered in-process
(the loop sends the problem back), so a few conversations may differ: the sides are compared by generated tokens per
second. They take turns within each repeat; the best repeat of each is reported with the load average, the engine's
prefill and decode calls, and the endpoint's own time per request (rendering, parsing and writing, without
generation), then where each side's time went: before the engine's first step (the first turns arriving), in its
steps, between them (the event loop's other work, or no turn ready), after its last step, and outside serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import openai
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "agents"))
from calculator_openai import CALCULATOR, HTTP  # noqa: E402
from rollout import timed  # noqa: E402

from hybridflow.batch_keys import (  # noqa: E402
    AGENT_FAILURE,
    AGENT_REQUESTS,
    AGENT_SERVER_SECONDS,
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    RAW_PROMPT,
    RESPONSE_MASK,
)
from hybridflow.data.tasks import make_task_rows  # noqa: E402
from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402
from hybridflow.rollout.agent import AgentRollout  # noqa: E402
from hybridflow.rollout.agent_server.rollout import AgentFunctionRollout  # noqa: E402
from hybridflow.rollout.base import SamplingParams  # noqa: E402
from hybridflow.rollout.native import NativeRollout  # noqa: E402
from hybridflow.tools import ToolSet  # noqa: E402
from hybridflow.tools.calculator import CalculatorTool, calculate  # noqa: E402
from hybridflow.trainer.setup.config import default_config  # noqa: E402

MAX_TURNS = 4
SKIPPED = "Error: at most 1 tool call(s) per turn; this one was not run"  # the in-process loop's text


def conversation(row: dict) -> list[dict]:
    """The task's chat (a task row's ``prompt``, the agent's row's ``raw_prompt``): the system message, the worked
    example (its tool message given the id the API asks for) and the question."""
    chat = row["raw_prompt"] if "raw_prompt" in row else row["prompt"]
    return [{**m, "tool_call_id": "example"} if m["role"] == "tool" else dict(m) for m in chat]


def agent(base_url: str, api_key: str, row: dict) -> float:
    """The calculator agent, as the in-process loop runs it: each turn's first call answered, the rest refused."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=HTTP)
    messages = conversation(row)
    for _ in range(MAX_TURNS):
        choice = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR]).choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            break
        for i, call in enumerate(choice.message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
                text = calculate(str(arguments.get("expression"))) if i == 0 else SKIPPED
            except Exception as error:  # noqa: BLE001
                text = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return 0.0


def rows_batch(rows: list[dict], prompts: list[list[int]], pad: int) -> DataProto:
    """The rows with their rendered prompts as left-padded tensors (the in-process loop's input) and raw_prompt."""
    width = max(map(len, prompts))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = torch.tensor(prompt), 1
    raw = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        raw[i] = conversation(row)
    position = (mask.cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict({INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: position}, {RAW_PROMPT: raw})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, dtype=parse_dtype(args.dtype)).eval()
    config = default_config().actor_rollout_ref.rollout
    native = NativeRollout(model, tokenizer, engine_config=config.native, stop_token_ids=None)
    multi_turn = dataclasses.replace(config.multi_turn, enable=True, max_assistant_turns=MAX_TURNS)
    in_process = AgentRollout(native, tokenizer, multi_turn, ToolSet([CalculatorTool()]))
    endpoint_config = dataclasses.replace(config.agent, function=f"{Path(__file__).resolve()}:agent")
    endpoint = AgentFunctionRollout(native, tokenizer, endpoint_config, tool_role="tool", format="hermes")
    rows = make_task_rows("calculator", args.requests, "test", 0)
    prompts = [endpoint.renderer.conversation_ids(conversation(row), [CALCULATOR]) for row in rows]
    batch = rows_batch(rows, prompts, native.pad_token_id)
    params = SamplingParams.greedy(max_new_tokens=128, seed=0)
    sides = {"in-process loop": in_process, "endpoint": endpoint}
    for rollout in sides.values():  # warm-up
        rollout.generate_sequences(batch[:4].select(deepcopy=True), params)
    print(f"load average before: {os.getloadavg()}; {args.requests} samples; threads {args.threads}")
    best: dict[str, tuple] = {}
    for _ in range(args.repeats):
        for name, rollout in sides.items():
            out = {}
            seconds, others = timed(
                lambda r=rollout, o=out: o.setdefault(
                    "batch", r.generate_sequences(batch.select(deepcopy=True), params)
                )
            )
            generated = int(out["batch"].batch[RESPONSE_MASK].sum())
            if name not in best or generated / seconds > best[name][0]:
                stats = dataclasses.replace(rollout.engine.stats)
                best[name] = (generated / seconds, seconds, generated, others, out["batch"], stats)
    header = f"{'side':<18}{'generated tok/s':>16}{'seconds':>9}{'tokens':>8}{'others CPU':>12}"
    print(f"{header}{'prefills':>10}{'decodes':>9}")
    for name, (rate, seconds, generated, others, _, stats) in best.items():
        print(
            f"{name:<18}{rate:>16.1f}{seconds:>9.2f}{generated:>8}{others:>11.0%}"
            f"{stats.prefill_calls:>10}{stats.decode_steps:>9}"
        )
    served = best["endpoint"][4]
    requests = int(served.batch[AGENT_REQUESTS].sum())
    server_ms = 1000 * float(served.batch[AGENT_SERVER_SECONDS].sum()) / max(1, requests)
    failures = sum(bool(f) for f in served.non_tensor_batch[AGENT_FAILURE])
    ratio = best["endpoint"][0] / best["in-process loop"][0]
    print(
        f"endpoint / in-process generated tok/s: {ratio:.3f} (overhead {1 - ratio:.1%}); {requests} requests, "
        f"{server_ms:.2f} ms of endpoint code per request, {failures} failed agents"
    )
    print("where each side's best repeat went, seconds (rollout/requests.py RequestStats):")
    print(f"{'side':<18}{'to 1st step':>12}{'in steps':>10}{'between':>9}{'after last':>11}{'outside':>9}")
    for name, (_, seconds, _, _, _, stats) in best.items():
        inside = stats.seconds_to_first_step + stats.step_seconds
        inside += stats.between_steps_seconds + stats.after_last_step_seconds
        print(
            f"{name:<18}{stats.seconds_to_first_step:>12.2f}{stats.step_seconds:>10.2f}"
            f"{stats.between_steps_seconds:>9.2f}{stats.after_last_step_seconds:>11.2f}{seconds - inside:>9.2f}"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
