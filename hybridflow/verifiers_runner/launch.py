"""Starting the verifiers runner (runner.py) in the environment's venv: ``describe`` an environment's tasks (the
data writer, and the run's check before it starts), or ``serve`` a generation call's sessions."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import IO, Any

RUNNER = Path(__file__).with_name("runner.py")
# the venv `make verifiers-env` builds beside the project's .venv (verifiers pins an openai older than the run's)
PROJECT_VENV = Path(__file__).resolve().parents[2] / ".venv-verifiers" / "bin" / "python"
DESCRIBE_TIMEOUT_S = 600.0


class EnvironmentRunnerError(RuntimeError):
    """The runner could not load the environment or list its tasks (the message says why)."""


def verifiers_python(configured: str = "") -> str:
    """The Python of the environment's venv: ``configured``, else $HYBRIDFLOW_VERIFIERS_PYTHON, else the project's
    .venv-verifiers; an error naming the fix when it does not exist."""
    path = configured or os.environ.get("HYBRIDFLOW_VERIFIERS_PYTHON") or str(PROJECT_VENV)
    if not Path(path).expanduser().is_file():
        raise EnvironmentRunnerError(
            f"no Python for verifiers environments at {path}: run `make verifiers-env` (a venv with verifiers "
            "0.4.0), or point rollout.agent.verifiers.python (or $HYBRIDFLOW_VERIFIERS_PYTHON) at one"
        )
    return str(Path(path).expanduser())


# set by the run's own Python (Ray's workers put the run's packages on PYTHONPATH): the runner's venv must not see
# the run's packages (another openai, transformers, ...)
_RUN_PYTHON_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONSAFEPATH")


def _environment(path: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _RUN_PYTHON_VARIABLES}
    if path:  # the environment's module, and the toolsets it starts as child processes, import from there
        env["PYTHONPATH"] = path
    return env


def _command(python: str, command: str, env_id: str, args: dict[str, Any], path: str) -> list[str]:
    return [python, str(RUNNER), command, "--env", env_id, "--args", json.dumps(args), "--path", path]


def describe_environment(python: str, env_id: str, args: dict[str, Any], path: str, limit: int) -> dict[str, Any]:
    """{"env", "tasks", "rows": [{"index", "prompt", "hash"}]}: the first ``limit`` tasks of the environment."""
    command = [*_command(python, "describe", env_id, args, path), "--limit", str(limit)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=DESCRIBE_TIMEOUT_S, env=_environment(path), check=False
        )
    except subprocess.TimeoutExpired:
        raise EnvironmentRunnerError(f"loading {env_id!r} took over {DESCRIBE_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise EnvironmentRunnerError(
            f"the verifiers environment {env_id!r} (args {json.dumps(args)}) does not load: "
            f"{lines[-1] if lines else 'exit ' + str(done.returncode)}"
            + ("" if path else "; is its module importable? (rollout.agent.verifiers.path names its directory)")
        )
    return json.loads(done.stdout)


def start_runner(
    python: str,
    env_id: str,
    args: dict[str, Any],
    path: str,
    *,
    run_key: str,
    tokenizer_dir: str,
    model: str,
    renderer: dict[str, Any],
    log: IO,
) -> subprocess.Popen:
    """The runner, loading the environment; it then serves one generation call per line on its stdin
    (`serve_call`) and exits when its stdin closes, so that it never outlives the process that started it. Its
    output goes to ``log``."""
    command = [
        *_command(python, "serve", env_id, args, path),
        *("--tokenizer", tokenizer_dir, "--model", model, "--renderer", json.dumps(renderer)),
    ]
    env = _environment(path) | {"HYBRIDFLOW_RUN_KEY": run_key}
    return subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def serve_call(process: subprocess.Popen, base_url: str, temperature: float, top_p: float) -> bool:
    """Ask the runner to claim and run the sessions of the endpoint at ``base_url``; False if it has exited."""
    try:
        process.stdin.write(json.dumps({"base_url": base_url, "temperature": temperature, "top_p": top_p}) + "\n")
        process.stdin.flush()
    except (BrokenPipeError, ValueError):  # exited (or its pipe was closed)
        return False
    return True
