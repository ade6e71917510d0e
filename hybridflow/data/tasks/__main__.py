"""python -m hybridflow.data.tasks {arithmetic,calculator,countdown} --out DIR --train N --test M --seed S [--gold]
python -m hybridflow.data.tasks reasoning_gym --out DIR --train N --test M --seed S --rg NAME [weight=W] [key=value ...]
    [--rg NAME ...]   (one --rg per reasoning-gym task of the mix, with its settings)
python -m hybridflow.data.tasks verifiers --out DIR --train N --test M --seed S --env ID [--env-args JSON]
    [--env-path DIR] [--python PY]   (rows naming a verifiers environment's tasks, for rollout.agent.verifiers)"""

from __future__ import annotations

import argparse
import json
import sys

from hybridflow.data.tasks import GOLD, TASKS, write_reasoning_gym, write_task, write_verifiers_env
from hybridflow.data.tasks.reasoning_gym import parse_spec
from hybridflow.validation import ArgumentParser, run_command, split_debug_flag
from hybridflow.verifiers_runner.launch import EnvironmentRunnerError, verifiers_python


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} rows: give a positive count")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m hybridflow.data.tasks", description=__doc__)
    parser.add_argument("task", choices=[*sorted(TASKS), "reasoning_gym", "verifiers"])
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train", type=_positive, default=5000, help="rows in the train split")
    parser.add_argument("--test", type=_positive, default=200, help="rows in the test split")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same files")
    parser.add_argument(
        "--gold",
        action="store_true",
        help=f"add each row's correct conversation for hybridflow sft ({', '.join(GOLD)})",
    )
    parser.add_argument(
        "--rg",
        nargs="+",
        action="append",
        default=[],
        metavar="WORD",
        help="reasoning_gym: one task of the mix, NAME [weight=W] [key=value ...] (its config's settings)",
    )
    parser.add_argument("--env", default="", help="verifiers: the environment's taskset id (an importable module)")
    parser.add_argument("--env-args", default="{}", help="verifiers: more of its config, as JSON")
    parser.add_argument("--env-path", default="", help="verifiers: a directory its module is in")
    parser.add_argument("--python", default="", help="verifiers: its venv's Python (default: .venv-verifiers)")
    args = parser.parse_args(argv)
    if args.task == "verifiers":
        return _write_verifiers(parser, args)
    if args.env:
        parser.error(f"--env is for the verifiers task, not {args.task}")
    if args.task == "reasoning_gym":
        if not args.rg or args.gold:
            parser.error("reasoning_gym: name its tasks with --rg NAME [key=value ...] (and no --gold)")
        try:  # bad words, unknown tasks or settings, too few distinct questions: refused before a file is written
            specs = [parse_spec(words) for words in args.rg]
            paths = write_reasoning_gym(specs, args.out, args.train, args.test, args.seed)
        except (ValueError, ImportError) as error:
            parser.error(str(error))
        for split, path in paths.items():
            print(f"{split}: {path}")
        return 0
    if args.rg:
        parser.error(f"--rg is for the reasoning_gym task, not {args.task}")
    if args.gold and args.task not in GOLD:
        parser.error(f"--gold: task {args.task!r} has no gold trajectories; tasks that have: {', '.join(GOLD)}")
    for split, path in write_task(args.task, args.out, args.train, args.test, args.seed, gold=args.gold).items():
        print(f"{split}: {path}")
    return 0


def _write_verifiers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.env or args.rg or args.gold:
        parser.error("verifiers: name the environment with --env ID (and no --rg or --gold)")
    try:
        env_args = json.loads(args.env_args)
    except json.JSONDecodeError as error:
        parser.error(f"--env-args is not JSON: {error}")
    if not isinstance(env_args, dict):
        parser.error("--env-args must be a JSON object of the environment's config keys")
    try:  # a missing venv, an environment that does not load, too few tasks: refused before a file is written
        python = verifiers_python(args.python)
        paths = write_verifiers_env(
            args.env, env_args, args.env_path, python, args.out, args.train, args.test, args.seed
        )
    except (ValueError, EnvironmentRunnerError) as error:
        parser.error(str(error))
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    debug, arguments = split_debug_flag(sys.argv[1:])
    sys.exit(run_command(lambda: main(arguments), debug))
