"""The default YAMLs' comments, written from the config dataclasses' help (``make format``; ``--check``: exit 1 if
one differs, as ``make lint`` runs it). Every command with a default YAML is listed here: the RL trainer's, the
supervised commands', the training service's.

    python -m hybridflow.config_yamls [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridflow.serve.config import SERVE_DEFAULT_CONFIG, ServeConfig
from hybridflow.trainer.commands.dpo import DPO
from hybridflow.trainer.commands.rm import RM
from hybridflow.trainer.commands.sft import SFT
from hybridflow.trainer.setup.config import DEFAULT_CONFIG, HybridFlowConfig
from hybridflow.trainer.setup.config_help import key_help, yaml_with_help


def default_yamls() -> list[tuple[Path, type]]:
    """Each default YAML with the config dataclass it fills."""
    supervised = [(command.default_config, command.config_class) for command in (SFT, DPO, RM)]
    return [(Path(DEFAULT_CONFIG), HybridFlowConfig), *supervised, (SERVE_DEFAULT_CONFIG, ServeConfig)]


def main(argv: list[str] | None = None) -> int:
    """Rewrite the default YAMLs' comments from the dataclasses (``--check``: exit 1 if they differ)."""
    args = sys.argv[1:] if argv is None else argv
    differ = 0
    for path, root in default_yamls():
        text = path.read_text()
        wanted = yaml_with_help(text, key_help(root))
        if wanted == text:
            continue
        if "--check" in args:
            print(f"{path}: comments differ from the dataclasses; run python -m {__spec__.name}")
            differ = 1
        else:
            path.write_text(wanted)
            print(f"rewrote the comments of {path}")
    return differ


if __name__ == "__main__":
    sys.exit(main())
