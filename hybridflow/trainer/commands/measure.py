"""``hybridflow measure``: a model's accuracy on a built-in task's test split, before any training.

    hybridflow measure arithmetic --model smollm2-135m-instruct --n 100
    hybridflow measure calculator --n 60 --tools examples/tools/calculator.yaml [--sample]
    hybridflow measure --data data/reasoning_gym/test.parquet --n 200 --max-new-tokens 64 [--sample]

``--data`` scores the rows of a data file (any task whose data source has a scorer: a reasoning-gym mix from
``python -m hybridflow.data.tasks reasoning_gym``), its first N rows, with accuracy per data source.

Generation is the trainer's: the native engine, and for rows that name an agent loop (multi-turn tasks)
the agent rollout with the given tools; scoring is the trainer's reward manager. Greedy by default;
``--sample`` samples at temperature 1 (the training setting). It is how a task's difficulty was chosen
(the task docstrings quote it), and it composes data, rollout, tools and reward, so it is a command of
the top layer, not part of data/.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from hybridflow.validation import ArgumentParser, reading_file


def main(argv: list[str] | None = None) -> int:
    import torch

    from hybridflow.batch_keys import (
        AGENT_NAME,
        DATA_SOURCE,
        EXTRA_INFO,
        PROMPT_TENSORS,
        RESPONSE_MASK,
        RESPONSES,
        TOOL_CALLS,
    )
    from hybridflow.data import RLHFDataset
    from hybridflow.data.io import read_rows, write_rows
    from hybridflow.data.tasks import TASKS, make_task_rows
    from hybridflow.models import load_causal_lm, load_tokenizer, model_config
    from hybridflow.reward import RewardFailure, RewardManager, check_scorable
    from hybridflow.rollout.base import SamplingParams
    from hybridflow.rollout.build import build_rollout
    from hybridflow.tools import load_tools
    from hybridflow.trainer.setup.config import default_config

    parser = ArgumentParser(prog="hybridflow measure", description=__doc__)
    parser.add_argument("task", nargs="?", choices=sorted(TASKS), help="a built-in task (or give --data)")
    parser.add_argument("--data", default="", help="a parquet/jsonl file of rows to score instead of a built-in task")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or local HF folder")
    parser.add_argument("--n", type=int, default=100, help="test prompts to score")
    parser.add_argument("--seed", type=int, default=0, help="the task seed (as for the generator CLI)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the response budget (multi-turn: all turns)")
    parser.add_argument("--tools", default="", help="tools YAML file, for tasks whose rows run an agent loop")
    parser.add_argument("--sample", action="store_true", help="sample at temperature 1 instead of greedy")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--show", type=int, default=5, help="print this many responses")
    args = parser.parse_args(argv)
    for flag, value in (("--n", args.n), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if bool(args.task) == bool(args.data):
        parser.error("name a built-in task or give --data FILE (one of the two)")
    model_fix = "a built-in name (smollm2-135m-instruct, tiny-llama) or a model folder"

    start = time.time()
    config = default_config()
    if args.data:
        with reading_file(args.data, key="--data", fix="a parquet or jsonl file of task rows"):
            rows = read_rows(args.data)[: args.n]
    else:
        rows = make_task_rows(args.task, args.n, "test", args.seed)
    if any(str(row.get(DATA_SOURCE, "")).startswith("verifiers:") for row in rows):
        parser.error(
            "--data: these rows name a verifiers environment's tasks, which its episodes score; evaluate them with "
            "a run's validation (rollout.agent.verifiers, docs/environments.md)"
        )
    try:  # every row scorable, before a model is loaded
        check_scorable(rows, multi_turn=any(row.get(AGENT_NAME) for row in rows))
    except RewardFailure as error:
        parser.error(f"--data: {error}")
    multi_turn = any(row.get(AGENT_NAME) for row in rows)
    if multi_turn and not args.tools:
        parser.error(f"the {args.task} rows run an agent loop: give its tools with --tools FILE")
    tools = load_tools(args.tools) if multi_turn else None
    with reading_file(args.model, key="--model", fix=model_fix):
        model_config(args.model)  # there, before a built-in is built or anything loads
    with reading_file(args.model, key="--model", fix=model_fix):
        tokenizer = load_tokenizer(args.model)
        model = load_causal_lm(args.model, dtype=getattr(torch, args.dtype)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_rows(rows, Path(tmp) / "test.parquet")
        dataset = RLHFDataset(path, tokenizer, dataclasses.replace(config.data, max_prompt_length=2048))
    # the default rollout settings (the native engine), with agent loops for multi-turn tasks
    rollout_config = config.actor_rollout_ref.rollout
    rollout_config = dataclasses.replace(
        rollout_config, multi_turn=dataclasses.replace(rollout_config.multi_turn, enable=multi_turn)
    )
    rollout = build_rollout(model, tokenizer, rollout_config, tools=tools)
    if args.sample:
        params = SamplingParams(
            do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.max_new_tokens, seed=args.seed
        )
    else:
        params = SamplingParams.greedy(max_new_tokens=args.max_new_tokens, seed=args.seed)
    loaded = time.time()

    batch = dataset.collate([dataset[i] for i in range(len(dataset))])
    prompts = batch.select(batch_keys=list(PROMPT_TENSORS), non_tensor_batch_keys=[AGENT_NAME, EXTRA_INFO])
    generated = rollout.generate_sequences(prompts.select(deepcopy=True), params)
    batch.pop(batch_keys=list(PROMPT_TENSORS))
    batch.union(generated)
    result = RewardManager(tokenizer, config.reward)(batch)
    done = time.time()

    by_level = defaultdict(list)
    sources = batch.non_tensor_batch[DATA_SOURCE]
    mixed = len(set(sources)) > 1  # several data sources: a line each
    scores = [float(score) for score in result.extra["score"]]
    for i, acc in enumerate(result.extra["acc"]):
        level = batch.non_tensor_batch[EXTRA_INFO][i].get("level")
        by_level[level or (sources[i] if mixed else "all")].append((float(acc), scores[i]))
        if i < args.show:
            n = int(batch.batch[RESPONSE_MASK][i].nonzero().max()) + 1 if batch.batch[RESPONSE_MASK][i].any() else 0
            print(f"acc={acc} score={scores[i]:.2f} response={tokenizer.decode(batch.batch[RESPONSES][i, :n])!r}")
    for level, pairs in sorted(by_level.items()):
        accs, level_scores = [a for a, _ in pairs], [s for _, s in pairs]
        print(
            f"  {level}: {sum(accs) / len(accs):.2f} (mean score {sum(level_scores) / len(level_scores):.2f}, "
            f"{len(accs)} prompts)"
        )
    accs = [float(a) for a in result.extra["acc"]]
    calls = ""
    if multi_turn:
        called = (batch.batch[TOOL_CALLS] > 0).tolist()
        unaided = [acc for acc, call in zip(accs, called) if not call]
        rate = sum(called) / len(called)
        calls = f", tool-call rate {rate:.2f}, {sum(unaided):.0f} of {len(unaided)} right without a call"
    print(
        f"{args.task or args.data} accuracy of {args.model}: {sum(accs) / len(accs):.3f} on {len(accs)} test prompts "
        f"({'sampled at T=1' if args.sample else 'greedy'}, {args.max_new_tokens} new tokens, {args.dtype}{calls}); "
        f"load {loaded - start:.1f}s, generate+score {done - loaded:.1f}s"
    )
    return 0
