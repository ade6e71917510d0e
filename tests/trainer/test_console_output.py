"""What a command prints: hybridflow's own lines, and none of other libraries' progress bars or start-up chatter
(``--debug`` lets them speak); a failing command's stderr is its error alone. Each command starts with an empty
model cache, so it converts its model as on a fresh machine: the conversion's bars would show if anything did."""

import os
import re
import subprocess
import sys

import pytest
import ray
from cache_helpers import built_models

from hybridflow.library_output import QUIET_ENV

pytestmark = pytest.mark.slow

# tqdm's bars (percent and rate), transformers' loading and saving bars, Ray's banners, vLLM's log lines (INFO or
# WARNING with its date) and its start's notices, Python's warnings from libraries
FOREIGN = re.compile(
    r"\d+%\||\d+it/s\]|s/it\]|Loading weights|Writing model shards|Started a local Ray instance|Connecting to "
    r"existing Ray cluster| INFO |(INFO|WARNING) \d\d-\d\d |Triton|NUMA binding|FutureWarning"
)


def train(args: list[str], cache, *, debug: bool = False) -> subprocess.CompletedProcess:
    """``python -m hybridflow.trainer.commands.train ARGS`` with the model cache ``cache``; its stdout and stderr. The
    libraries' switches are left out of its environment (this process has them from the commands its other tests
    ran here): the command sets them itself, or not with --debug."""
    env = {key: value for key, value in os.environ.items() if key not in {"HYBRIDFLOW_DEBUG", *QUIET_ENV}}
    env["HYBRIDFLOW_CACHE"] = str(cache)
    command = [sys.executable, "-m", "hybridflow.trainer.commands.train", *args, *(["--debug"] if debug else [])]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def arguments(files, run_dir, *extra: str) -> list[str]:
    train_file, test_file = files
    return [
        f"data.train_files=[{train_file}]",
        f"data.val_files=[{test_file}]",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


def test_a_short_run_prints_its_own_progress_and_no_library_s(local_ray, arithmetic_files, tmp_path):
    """Two PPO steps with a critic and a reference (every role loads a model) on the Ray cluster of this process."""
    cache = tmp_path / "cache"
    roles = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_kl_loss=true"]
    cluster = f"trainer.ray_address={ray.get_runtime_context().gcs_address}"
    args = arguments(arithmetic_files, tmp_path / "run", "trainer.total_training_steps=2", *roles, cluster)
    done = train(args, cache)
    assert done.returncode == 0, done.stderr
    assert built_models(cache)  # converted in this run
    assert (
        "hybridflow: gae for 2 steps on 2 workers" in done.stdout and f"; run dir {tmp_path / 'run'}\n" in done.stdout
    )
    assert "step 2/2 (100%)" in done.stdout and "critic/vf_loss" in done.stdout  # the progress line, the metrics
    output = done.stdout + done.stderr
    assert FOREIGN.findall(output) == [], output


def test_a_failing_command_prints_its_error_alone_after_a_conversion(arithmetic_files, tmp_path):
    """Prompts too long for data.max_prompt_length: found once the tokenizer is there, after the model is built.
    The error is all of stderr; with --debug the libraries speak, and the traceback comes too."""
    args = arguments(arithmetic_files, tmp_path / "run", "data.max_prompt_length=3")
    done = train(args, tmp_path / "cache")
    assert done.returncode == 2 and built_models(tmp_path / "cache")
    first, *rest = done.stderr.strip().splitlines()
    assert first.startswith("hybridflow: error: config key 'data.max_prompt_length': every prompt")
    assert all(line.startswith("  ") for line in rest), done.stderr
    assert FOREIGN.findall(done.stdout + done.stderr) == []

    debug = train(args, tmp_path / "debug-cache", debug=True)
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert "Writing model shards" in debug.stderr  # what the first command kept quiet
    assert debug.stderr.rstrip().splitlines()[-2].startswith("hybridflow: error: config key 'data.max_prompt_length'")
