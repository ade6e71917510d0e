"""Runs a verifiers environment for a hybridflow run, in the environment's own venv (verifiers pins an ``openai``
older than the run's; nothing here imports hybridflow or torch).

    python runner.py describe --env ID [--args JSON] [--path DIR] [--limit N]
        prints one JSON object: {"env", "tasks": how many were read, "rows": [{"index", "prompt", "hash"}]},
        the tasks' prompts as chat messages, for the data writer (and the run's check before it starts)

    python runner.py serve --env ID [--args JSON] [--path DIR] --tokenizer DIR --model NAME [--renderer JSON]
                           [--max-sessions N]
        with the run's key in $HYBRIDFLOW_RUN_KEY, for each line {"base_url", "temperature", "top_p"} on stdin (one
        per generation call): claims that endpoint's waiting sessions until none is left, runs each session's task
        (its row's extra_info.task_index) as one episode whose model calls go to the session's token route
        (/inference/v1/generate, rendered by verifiers' own TrainClient), then posts the episode's reward, its
        metrics and its trace's branches (which the endpoint checks token for token against what it generated), or
        gives the session up with the reason.

The environment's config is ``{"taskset": {"id": ENV}, "agent": {"harness": {"id": "hybridflow-chat"}, "runtime":
{"type": "subprocess"}}}`` with ``--args`` merged over it: the in-process harness of hybridflow_chat.py and a local
runtime, so that nothing is fetched while a run trains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import traceback
from itertools import islice
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer is the run's, from a directory: never the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # the hybridflow-chat harness


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_env(env_id: str, args: dict[str, Any]):
    import verifiers.v1 as vf

    seat = {"harness": {"id": "hybridflow-chat"}, "runtime": {"type": "subprocess"}}
    return vf.load_environment(vf.resolve_env_config(merged({"taskset": {"id": env_id}, "agent": seat}, args)))


def prompt_messages(task) -> list[dict[str, Any]]:
    """The task's opening conversation as chat messages (what the data set shows as the row's prompt)."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if getattr(data, "system_prompt", None) else []
    prompt = data.prompt
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt:
        for message in prompt:
            wire = message if isinstance(message, dict) else message.model_dump(exclude_none=True)
            content = wire.get("content")
            messages.append({"role": wire.get("role"), "content": content if isinstance(content, str) else ""})
    return messages


class Tasks:
    """The taskset's tasks by index, read lazily (a taskset may be a generator, even an endless one)."""

    def __init__(self, taskset):
        self.iterator = iter(taskset)
        self.read: list = []

    def __getitem__(self, index: int):
        if index >= len(self.read):
            self.read += list(islice(self.iterator, index + 1 - len(self.read)))
        if index >= len(self.read):
            raise IndexError(f"the environment has {len(self.read)} tasks; the row asks for task {index}")
        return self.read[index]


def describe(options: argparse.Namespace) -> None:
    env = load_env(options.env, json.loads(options.args))
    tasks = list(islice(iter(env.taskset), options.limit))
    rows = [{"index": i, "prompt": prompt_messages(task), "hash": task.hash} for i, task in enumerate(tasks)]
    print(json.dumps({"env": options.env, "tasks": len(rows), "rows": rows}))


def trace_branches(trace) -> list[dict[str, Any]]:
    return [
        {
            "token_ids": list(branch.token_ids),
            "sampled_mask": [bool(m) for m in branch.sampled_mask],
            "logprobs": [float(lp) for lp in branch.logprobs],
        }
        for branch in trace.branches
    ]


def outcome(episode) -> dict[str, Any]:
    """The body posted for one episode: its reward and metrics with its trace's branches, or why it failed."""
    problems = [f"{e.type}: {e.message}" for e in episode.errors]
    if len(episode.traces) != 1:
        problems.append(f"the episode has {len(episode.traces)} traces; a session trains one agent's trace")
    trace = episode.traces[0] if episode.traces else None
    if trace is not None:
        problems += [f"{e.type}: {e.message}" for e in trace.errors]
        if not trace.ok:
            problems.append(f"the trace stopped with {trace.stop_condition}")
    if problems or trace is None:
        return {"abandon": True, "reason": "; ".join(problems)[:2000]}
    metrics = {f"metric/{name}": float(value) for name, value in (trace.metrics or {}).items()}
    for name, reward in (trace.rewards or {}).items():
        if reward is not None:
            metrics[f"reward/{name}"] = float(reward.score)
    metrics["turns"] = float(trace.num_turns)
    metrics["truncated"] = float(bool(trace.is_truncated))
    return {"reward": float(trace.reward or 0.0), "metrics": metrics, "branches": trace_branches(trace)}


async def run_session(
    env, tasks: Tasks, session: dict[str, Any], call: dict[str, Any], options: argparse.Namespace, http
) -> None:
    import verifiers.v1 as vf

    auth = {"Authorization": f"Bearer {session['api_key']}"}
    reward_url = session["base_url"].removesuffix("/v1") + "/reward"
    try:
        extra = session["row"].get("extra_info") or {}
        if "task_index" not in extra:
            raise ValueError("the row's extra_info has no task_index: write the data with the verifiers data writer")
        task = tasks[int(extra["task_index"])]
        if extra.get("task_hash") and extra["task_hash"] != task.hash:
            raise ValueError(
                f"task {extra['task_index']} of {options.env} is not the one the data was written from (its hash "
                "differs): the environment or its args changed; write the data again"
            )
        client = vf.TrainClientConfig(
            base_url=session["base_url"],
            api_key_var="HYBRIDFLOW_SESSION_KEY_UNUSED",  # the session's key travels in the header below
            headers=auth,
            renderer_model_name=options.tokenizer,
            renderer=json.loads(options.renderer),
        )
        sampling = vf.SamplingConfig(temperature=call["temperature"], top_p=call["top_p"])
        episode = await env.run_episode(task, vf.ModelContext(model=options.model, client=client, sampling=sampling))
        body = outcome(episode)
    except Exception as error:  # noqa: BLE001  (one episode's failure is its sample's, reported to the run)
        body = {"abandon": True, "reason": f"{type(error).__name__}: {error}"}
        traceback.print_exc(file=sys.stderr)
    async with http.post(reward_url, json=body, headers=auth) as posted:
        if posted.status != 200:
            print(f"posting {session['session_id']}'s outcome: {posted.status} {await posted.text()}", file=sys.stderr)


async def serve_call(env, tasks: Tasks, call: dict[str, Any], options: argparse.Namespace, http) -> int:
    """Claim the waiting sessions of one generation call's endpoint and run their episodes; how many there were."""
    auth = {"Authorization": f"Bearer {os.environ['HYBRIDFLOW_RUN_KEY']}"}
    sessions = []
    while True:  # all claimed before any episode starts (an episode's first steps can hold this loop for seconds)
        async with http.post(f"{call['base_url']}/v1/sessions/claim", headers=auth) as claimed:
            if claimed.status == 204:  # every session of the call is open before it serves: none is left
                break
            claimed.raise_for_status()
            sessions.append(await claimed.json())
    await asyncio.gather(*(run_session(env, tasks, session, call, options, http) for session in sessions))
    return len(sessions)


async def serve(options: argparse.Namespace) -> None:
    """One line on stdin per generation call ({"base_url", "temperature", "top_p"}); the environment is loaded
    once. Exits when stdin closes (the run is done, or gone) or after --max-sessions sessions (the run starts a
    fresh runner: verifiers keeps a client per endpoint it has called)."""
    import aiohttp  # verifiers' own HTTP client library

    env = load_env(options.env, json.loads(options.args))
    tasks = Tasks(env.taskset)
    print(json.dumps({"ready": options.env}), flush=True)
    served = 0
    loop = asyncio.get_running_loop()
    while served < options.max_sessions:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        # a connection per request: the endpoint closes idle connections after seconds, and each call's endpoint
        # listens on a fresh port, which the system may give again to a later call
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(connect=60)) as http:
            served += await serve_call(env, tasks, json.loads(line), options, http)
        print(json.dumps({"served": served}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("describe", "serve"):
        command = commands.add_parser(name)
        command.add_argument("--env", required=True)
        command.add_argument("--args", default="{}")
        command.add_argument("--path", default="")
        if name == "describe":
            command.add_argument("--limit", type=int, default=100_000)
        else:
            command.add_argument("--tokenizer", required=True)
            command.add_argument("--model", required=True)
            command.add_argument("--renderer", default='{"name": "default"}')
            command.add_argument("--max-sessions", type=int, default=4096)
    options = parser.parse_args()
    if options.path:
        sys.path.insert(0, options.path)
    if options.command == "describe":
        describe(options)
    else:
        asyncio.run(serve(options))


if __name__ == "__main__":
    main()
