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

import time
from collections import defaultdict

from hybridflow.validation import ArgumentParser


def measure_parser():
    from hybridflow.data.tasks import TASKS

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
    return parser


def main(argv: list[str] | None = None) -> int:
    from hybridflow.rollout.base import SamplingParams
    from hybridflow.tools import load_tools
    from hybridflow.trainer.commands.generation_rows import is_multi_turn, load_generator, scorable_rows

    parser = measure_parser()
    args = parser.parse_args(argv)
    for flag, value in (("--n", args.n), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if bool(args.task) == bool(args.data):
        parser.error("name a built-in task or give --data FILE (one of the two)")

    start = time.time()
    rows = scorable_rows(parser, task=args.task, data=args.data, n=args.n, split="test", seed=args.seed)
    multi_turn = is_multi_turn(rows)
    if multi_turn and not args.tools:
        parser.error(f"the {args.task} rows run an agent loop: give its tools with --tools FILE")
    tools = load_tools(args.tools) if multi_turn else None
    generator = load_generator(args.model, args.dtype, rows, multi_turn=multi_turn, tools=tools)
    if args.sample:
        params = SamplingParams(
            do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.max_new_tokens, seed=args.seed
        )
    else:
        params = SamplingParams.greedy(max_new_tokens=args.max_new_tokens, seed=args.seed)
    loaded = time.time()
    batch, result = generator.generate(params)
    done = time.time()
    accs = print_accuracy(args, generator.tokenizer, batch, result, multi_turn)
    print(
        f"{args.task or args.data} accuracy of {args.model}: {sum(accs) / len(accs):.3f} on {len(accs)} test prompts "
        f"({'sampled at T=1' if args.sample else 'greedy'}, {args.max_new_tokens} new tokens, {args.dtype}"
        f"{tool_calls(batch, accs) if multi_turn else ''}); load {loaded - start:.1f}s, generate+score "
        f"{done - loaded:.1f}s"
    )
    return 0


def print_accuracy(args, tokenizer, batch, result, multi_turn: bool) -> list[float]:
    """The first ``args.show`` responses and the accuracy by level (or data source); each prompt's accuracy."""
    from hybridflow.batch_keys import DATA_SOURCE, EXTRA_INFO, RESPONSE_MASK, RESPONSES

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
    return [float(a) for a in result.extra["acc"]]


def tool_calls(batch, accs: list[float]) -> str:
    """How often an agent loop called a tool, and what it got right without one."""
    from hybridflow.batch_keys import TOOL_CALLS

    called = (batch.batch[TOOL_CALLS] > 0).tolist()
    unaided = [acc for acc, call in zip(accs, called) if not call]
    return (
        f", tool-call rate {sum(called) / len(called):.2f}, {sum(unaided):.0f} of {len(unaided)} right without a call"
    )
