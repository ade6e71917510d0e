"""The layer rules (pyproject.toml's import-linter contracts) hold, and break when code breaks them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """lint-imports with the project's contracts on the ``hybridflow`` package found in ``package_parent``."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=package_parent,
        env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def package_copy(tmp_path) -> Path:
    shutil.copytree(ROOT / "hybridflow", tmp_path / "hybridflow", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def add_line(file: Path, line: str) -> None:
    file.write_text(file.read_text() + f"\n{line}\n")


def test_the_package_keeps_every_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    "file, line, broken",
    [
        # an upward import: the engine reaching into the trainer
        ("engine/fsdp.py", "from hybridflow.trainer.setup.config import HybridFlowConfig", "Layers"),
        # an upward import hidden in a function still counts
        ("algorithms/kl.py", "def _late():\n    import hybridflow.rollout.base", "Layers"),
        # a cycle inside a package, kept alive by a type hint
        (
            "rollout/sampling.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hybridflow.rollout import base",
            "No import cycles",
        ),
        # reaching a backend around its registration
        ("workers/actor_rollout.py", "from hybridflow.rollout.native import NativeRollout", "Rollout backends"),
        # a run service reaching up into the loop
        ("trainer/services/checkpoint.py", "from hybridflow.trainer.loop import step_loop", "The trainer's parts"),
        # the driver running a training pass itself
        (
            "trainer/loop/rl_trainer.py",
            "from hybridflow.engine.update import run_updates",
            "The driver runs no training",
        ),
    ],
)
def test_a_deliberate_violation_breaks_its_contract(package_copy, file, line, broken):
    add_line(package_copy / "hybridflow" / file, line)
    result = lint_imports(package_copy)
    assert result.returncode == 1, result.stdout
    broken_section = result.stdout.split("Broken contracts")[1]  # an upward import is also a cycle of packages
    assert broken in broken_section, result.stdout
