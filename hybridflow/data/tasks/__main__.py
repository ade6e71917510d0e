"""python -m hybridflow.data.tasks {arithmetic,calculator,countdown} --out DIR --train N --test M --seed S [--gold]"""

from __future__ import annotations

import argparse
import sys

from hybridflow.data.tasks import GOLD, TASKS, write_task
from hybridflow.validation import ArgumentParser, run_command, split_debug_flag


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} rows: give a positive count")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m hybridflow.data.tasks", description=__doc__)
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train", type=_positive, default=5000, help="rows in the train split")
    parser.add_argument("--test", type=_positive, default=200, help="rows in the test split")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same files")
    parser.add_argument(
        "--gold",
        action="store_true",
        help=f"add each row's correct conversation for hybridflow sft ({', '.join(GOLD)})",
    )
    args = parser.parse_args(argv)
    if args.gold and args.task not in GOLD:
        parser.error(f"--gold: task {args.task!r} has no gold trajectories; tasks that have: {', '.join(GOLD)}")
    for split, path in write_task(args.task, args.out, args.train, args.test, args.seed, gold=args.gold).items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    debug, arguments = split_debug_flag(sys.argv[1:])
    sys.exit(run_command(lambda: main(arguments), debug))
