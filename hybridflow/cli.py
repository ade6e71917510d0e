"""The ``hybridflow`` command."""

from __future__ import annotations

import sys

USAGE = """usage: hybridflow <command> [args]

commands:
  train [--config FILE] key=value ...   run PPO/GRPO training (keys: hybridflow/config/ppo_trainer.yaml)
  export CHECKPOINT OUT_DIR             write a checkpoint's actor as a Hugging Face model directory
  report RUN_DIR [--out DIR]            draw a run's curves into PNGs and one self-contained HTML page
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "train":
        from hybridflow.trainer.main import main as train

        train(rest)
        return 0
    if command == "export" and len(rest) == 2:
        from hybridflow.trainer.export import export_checkpoint

        print(f"exported to {export_checkpoint(rest[0], rest[1])}")
        return 0
    if command == "report":
        from hybridflow.report import main as report

        return report(rest)
    print(f"unknown command or arguments: {' '.join(args)}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
