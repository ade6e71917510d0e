"""The ``hybridflow`` command.

An error in what the user gave (``UserError``: a config key, a file, a command's arguments) is
printed as one message and the command exits with code 2; ``--debug`` (anywhere on the line) or
``HYBRIDFLOW_DEBUG=1`` shows the traceback as well.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from hybridflow.validation import UserError, run_command, split_debug_flag

USAGE = """usage: hybridflow <command> [--debug] [args]

commands:
  train [--config FILE] key=value ...   run PPO/GRPO training (hybridflow train --help lists the config sections)
  sft [--config FILE] key=value ...     supervised fine-tuning on conversations (hybridflow sft --help)
  dpo [--config FILE] key=value ...     direct preference optimisation on chosen/rejected pairs (hybridflow dpo --help)
  rm [--config FILE] key=value ...      train a reward model on chosen/rejected pairs (hybridflow rm --help)
  export CHECKPOINT|RUN_DIR OUT_DIR [--merged]
                                        write a checkpoint's model (a run's latest) as a Hugging Face model directory
  report RUN_DIR [--out DIR]            draw a run's curves into PNGs and one self-contained HTML page
  measure TASK [--model M] [--n N] [--tools FILE] ...
                                        a model's accuracy on a built-in task's test prompts, before training
  distill-data TASK --model TEACHER --out FILE [--samples K] [--keep all|correct] ...
                                        a teacher's sampled answers to a task's prompts, as an SFT data set
  serve [--config FILE] key=value ...   a training service with the Tinker API on this machine (docs/serve.md)
  plan [--config FILE] [--cluster NAME] [--nodes N] key=value ...
                                        choose the placement and parallel layouts of a run (writes plan.yaml)
  upcycle MODEL OUT [--experts E] [--top-k K]
                                        a dense model as a mixture of experts that answers exactly as it does
"""

EXPORT_USAGE = """usage: hybridflow export CHECKPOINT|RUN_DIR OUT_DIR [--merged]

Writes the actor of a checkpoint (a global_step_N directory, or a run directory: its latest
complete checkpoint) as a plain Hugging Face model directory (safetensors, config, tokenizer).
An actor trained with LoRA is written as peft's adapter directory (adapter_model.safetensors,
adapter_config.json naming the base model; peft.PeftModel.from_pretrained loads it), or with
--merged as the base model with the adapters merged in.
"""


def _train(args: list[str]) -> int:
    from hybridflow.trainer.commands.train import main as train

    return train(args)


def _sft(args: list[str]) -> int:
    from hybridflow.trainer.commands.sft import main as sft

    return sft(args)


def _dpo(args: list[str]) -> int:
    from hybridflow.trainer.commands.dpo import main as dpo

    return dpo(args)


def _rm(args: list[str]) -> int:
    from hybridflow.trainer.commands.rm import main as rm

    return rm(args)


def _serve(args: list[str]) -> int:
    from hybridflow.serve.main import main as serve

    return serve(args)


def _export(args: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in args):
        print(EXPORT_USAGE)
        return 0
    merged = "--merged" in args
    paths = [arg for arg in args if arg != "--merged"]
    if len(paths) != 2:
        raise UserError(f"export takes a checkpoint (or run directory) and an output directory\n\n{EXPORT_USAGE}")
    from hybridflow.trainer.commands.export import export_checkpoint

    print(f"exported to {export_checkpoint(paths[0], paths[1], merged=merged)}")
    return 0


def _report(args: list[str]) -> int:
    from hybridflow.report import main as report

    return report(args)


def _measure(args: list[str]) -> int:
    from hybridflow.trainer.commands.measure import main as measure

    return measure(args)


def _distill_data(args: list[str]) -> int:
    from hybridflow.trainer.commands.distill_data import main as distill_data

    return distill_data(args)


def _upcycle(args: list[str]) -> int:
    from hybridflow.trainer.commands.upcycle import main as upcycle

    return upcycle(args)


def _plan(args: list[str]) -> int:
    from hybridflow.planner.command import main as plan

    return plan(args)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _train,
    "sft": _sft,
    "dpo": _dpo,
    "rm": _rm,
    "serve": _serve,
    "export": _export,
    "report": _report,
    "plan": _plan,
    "measure": _measure,
    "distill-data": _distill_data,
    "upcycle": _upcycle,
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug, args = split_debug_flag(args)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"hybridflow: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run_command(lambda: COMMANDS[command](rest), debug)


if __name__ == "__main__":
    sys.exit(main())
