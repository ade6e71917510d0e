"""Multi-turn rollout throughput: turns that continue from the cache against the same conversations re-prefilled
from scratch at every turn (run by hand, not a test).

    .venv/bin/python bench/agent_rollout.py                        # both workloads, native engine, smollm2
    .venv/bin/python bench/agent_rollout.py --backends native,vllm --repeats 3
    .venv/bin/python bench/agent_rollout.py --whole-rows --breakdown   # ragged decode against whole rows

Workloads (greedy; in bf16 the two modes round differently, so their conversations can part after a while):
  scripted    the calculator task's prompts (system message and a worked example, ~150 tokens); --turns turns
              of exactly --turn-tokens generated tokens, each followed by a tool message of --tool-tokens
              tokens (the chat template's tokens around it included): long contexts, many turns, and the
              same work in both modes whatever the tokens (checked)
  calculator  the real `tool_agent` loop with the calculator on the calculator task: the model calls the tool,
              reads its answer and answers (about two short turns); the modes are compared by generated
              tokens per second, since a few conversations may differ
Modes: `reuse` (a later turn computes only the tokens appended since the last one: the default), `scratch`
(every turn recomputes the whole conversation: the native engine's `reuse_cache=False`; vLLM with prefix
caching off); with --whole-rows the native engine also runs `reuse, whole rows`, decode attending over each
slot's whole preallocated row instead of its real length (rollout.native.ragged_decode=false). vLLM's prefix
cache is emptied before each timed run, as a weight load empties it in training, so no run finds the
conversations of the last one. The modes take turns within each repeat, so
load from other processes spreads over both; the best repeat of each is reported, with the tokens each
mode computed in prefill (vLLM: the prompt tokens it did not find cached) and the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
from rollout import forget_prompts, timed

from hybridflow.batch_keys import AGENT_NAME, ATTENTION_MASK, EXTRA_INFO, PROMPT_TENSORS, RESPONSE_MASK, RESPONSES
from hybridflow.data import RLHFDataset
from hybridflow.data.io import write_rows
from hybridflow.data.tasks import make_task_rows
from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype
from hybridflow.rollout.agent import AgentLoop, AgentRollout, RequestState, register_agent_loop
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.sessions import NativeRequestEngine
from hybridflow.tools import ToolSet
from hybridflow.tools.calculator import CalculatorTool
from hybridflow.trainer.setup.config import default_config

TURNS, TURN_TOKENS, TOOL_TEXT = 4, 32, "x"


class FixedTurns(AgentLoop):
    """TURNS turns of exactly TURN_TOKENS tokens (the engine has no stop tokens), a tool message between them."""

    async def run(self, trajectory, context):
        trajectory.move_to(RequestState.GENERATING)
        new_tokens = trajectory.prompt
        for turn in range(TURNS):
            trajectory.add_generated(await context.engine.generate(trajectory.request, new_tokens, TURN_TOKENS))
            if turn == TURNS - 1:
                break
            new_tokens = context.chat.tool_response_ids([TOOL_TEXT])
            trajectory.add_inserted(new_tokens)
        trajectory.finish("no_tool_call")


register_agent_loop("bench_fixed_turns", FixedTurns)


def calculator_prompts(tokenizer, count: int, agent: str):
    rows = make_task_rows("calculator", count, "test", 0)
    for row in rows:
        row[AGENT_NAME] = agent
    config = dataclasses.replace(default_config().data, max_prompt_length=4096)
    path = write_rows(rows, Path(f"/tmp/bench_agent_rollout_{os.getpid()}.parquet"))
    dataset = RLHFDataset(path, tokenizer, config)
    path.unlink()
    batch = dataset.collate([dataset[i] for i in range(len(dataset))])
    return batch.select(batch_keys=list(PROMPT_TENSORS), non_tensor_batch_keys=[AGENT_NAME, EXTRA_INFO])


def agent_rollouts(backend: str, model, tokenizer, scripted: bool, whole_rows: bool) -> dict[str, AgentRollout]:
    """{"reuse": ..., "scratch": ...} agent rollouts over one backend (native with ``whole_rows``: and
    "reuse, whole rows", decode attending over the slots' whole preallocated rows)."""
    stop = [] if scripted else None
    multi_turn = dataclasses.replace(default_config().actor_rollout_ref.rollout.multi_turn, enable=True)
    tools = ToolSet([CalculatorTool()])
    if backend == "native":
        native = NativeRollout(
            model, tokenizer, engine_config=default_config().actor_rollout_ref.rollout.native, stop_token_ids=stop
        )
        reuse = AgentRollout(native, tokenizer, multi_turn, tools)
        scratch = AgentRollout(native, tokenizer, multi_turn, tools)
        scratch.engine = NativeRequestEngine(native.engine, native.stop_token_ids, reuse_cache=False)
        rollouts = {"reuse": reuse, "scratch": scratch}
        if whole_rows:  # decode over the slots' whole rows, as before the ragged kernel
            config = dataclasses.replace(default_config().actor_rollout_ref.rollout.native, ragged_decode=False)
            rows = NativeRollout(model, tokenizer, engine_config=config, stop_token_ids=stop)
            rollouts["reuse, whole rows"] = AgentRollout(rows, tokenizer, multi_turn, tools)
        return rollouts
    from hybridflow.rollout.vllm.rollout import VllmRollout

    rollouts = {}
    for mode, caching in (("reuse", True), ("scratch", False)):
        config = dataclasses.replace(
            default_config().actor_rollout_ref.rollout.vllm, block_size=32, enable_prefix_caching=caching
        )
        vllm = VllmRollout(model, tokenizer, engine_config=config, stop_token_ids=stop)
        rollouts[mode] = AgentRollout(vllm, tokenizer, multi_turn, tools)
    return rollouts


def race(rollouts: dict[str, AgentRollout], prompts, params, repeats: int) -> tuple[dict, dict, dict, dict]:
    """The modes in turn, ``repeats`` times: each one's best (seconds, others' CPU share), last output, stats and
    the native engine's calls in its best run (with --breakdown)."""
    best, outputs, stats, calls = {}, {}, {}, {}
    for _ in range(repeats):
        for mode, rollout in rollouts.items():

            def run(rollout=rollout, mode=mode):
                outputs[mode] = rollout.generate_sequences(prompts.select(deepcopy=True), params)

            forget_prompts(rollout.backend)
            ENGINE_CALLS.clear()
            result = timed(run)
            if result < best.get(mode, (float("inf"), 0.0)):
                best[mode], calls[mode] = result, dict(ENGINE_CALLS)
            stats[mode] = dataclasses.replace(rollout.engine.stats)
    return best, outputs, stats, calls


ENGINE_CALLS: dict[str, list[float]] = {}  # native engine function -> [seconds, calls] during the current run


def time_native_engine_calls() -> None:
    """Count the seconds of the native engine's forwards and cache copies (--breakdown)."""
    from hybridflow.rollout.native import kv_cache, model

    def timed_call(owner, name: str) -> None:
        function = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                entry = ENGINE_CALLS.setdefault(name, [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1

        setattr(owner, name, wrapper)

    for name in ("decode", "extend", "prefill"):
        timed_call(model, name)
    timed_call(kv_cache.KVCache, "copy_slots")


def main() -> None:
    global TURNS, TURN_TOKENS, TOOL_TEXT
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", default="scripted,calculator")
    parser.add_argument("--backends", default="native", help="comma list of native, vllm")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--turn-tokens", type=int, default=TURN_TOKENS)
    parser.add_argument("--tool-tokens", type=int, default=24, help="scripted: tokens of each tool message's text")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--whole-rows", action="store_true", help="native: also reuse mode with decode over whole cache rows"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="native: seconds in decode, extend, prefill and slot copies"
    )
    args = parser.parse_args()
    if args.breakdown:
        time_native_engine_calls()
    TURNS, TURN_TOKENS = args.turns, args.turn_tokens
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    tokenizer = load_tokenizer(args.model)
    TOOL_TEXT = tokenizer.decode(
        tokenizer.encode(" 7" * args.tool_tokens, add_special_tokens=False)[: args.tool_tokens]
    )
    model = load_causal_lm(args.model, dtype=dtype).eval()
    print(f"load average before: {os.getloadavg()}; threads {args.threads}; dtype {dtype}; {args.requests} requests")
    rows = []
    for workload in args.workloads.split(","):
        scripted = workload == "scripted"
        prompts = calculator_prompts(tokenizer, args.requests, "bench_fixed_turns" if scripted else "tool_agent")
        budget = TURNS * (TURN_TOKENS + args.tool_tokens + 16) if scripted else 128
        params = SamplingParams.greedy(max_new_tokens=budget, seed=0)
        for backend in args.backends.split(","):
            rollouts = agent_rollouts(backend, model, tokenizer, scripted, args.whole_rows)
            for rollout in rollouts.values():  # warm-up
                rollout.generate_sequences(prompts[:4].select(deepcopy=True), params)
            best, outputs, stats, calls = race(rollouts, prompts, params, args.repeats)
            for mode, spent in calls.items():
                if spent:
                    parts = ", ".join(f"{name} {sec:.2f} s ({count} calls)" for name, (sec, count) in spent.items())
                    print(f"{workload}/{backend}/{mode} (best run): {parts}", flush=True)
            reuse, scratch = (outputs[m].batch for m in ("reuse", "scratch"))
            same_lengths = torch.equal(reuse[ATTENTION_MASK], scratch[ATTENTION_MASK])
            if scripted and not same_lengths:  # fixed-length turns: the same work by construction
                sys.exit(f"{workload}/{backend}: the modes' conversations differ in length")
            real = reuse[ATTENTION_MASK][:, -budget:].bool()
            agreement = float((reuse[RESPONSES] == scratch[RESPONSES])[real].float().mean())
            for mode in rollouts:
                seconds, others = best[mode]
                batch = outputs[mode].batch
                generated = int(batch[RESPONSE_MASK].sum())
                length = float(batch[ATTENTION_MASK][:, -budget:].sum(1).float().mean())
                rows.append((workload, backend, mode, seconds, generated, stats[mode].prefill_tokens, others, length))
            print(
                f"{workload}/{backend}: the same lengths in both modes: {same_lengths}; the same token at "
                f"{100 * agreement:.1f}% of the response positions (bf16: a prefix computed in one forward and "
                "turn by turn rounds differently, and greedy choices between near-equal tokens follow)",
                flush=True,
            )
    print(
        "\n| workload | backend | mode | seconds | generated tokens | generated tokens/s | prefill tokens "
        "| tokens/s vs scratch | mean response tokens | CPU used by others |"
    )
    print("| --- " * 10 + "|")
    speed = {(w, b, m): g / s for w, b, m, s, g, *_ in rows}
    for workload, backend, mode, seconds, generated, prefill, others, length in rows:
        ratio = speed[(workload, backend, mode)] / speed[(workload, backend, "scratch")]
        print(
            f"| {workload} | {backend} | {mode} | {seconds:.2f} | {generated} | {generated / seconds:.0f} | {prefill} "
            f"| {ratio:.2f}x | {length:.0f} | {100 * others:.0f}% |"
        )
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"{time.time() - start:.0f} s in all")
