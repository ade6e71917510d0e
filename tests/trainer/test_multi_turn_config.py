"""Multi-turn settings that cannot work stop the run before Ray starts, naming the key and the fix."""

import pytest
import ray

from hybridflow.data.io import write_rows
from hybridflow.data.tasks import make_task_rows
from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.config import ConfigError, load_config
from hybridflow.trainer.setup.run_plan import make_run_plan

# checks that nothing started Ray, or runs that start and end their own cluster: the shared one (tests/conftest.py)
# is shut down first
pytestmark = pytest.mark.usefixtures("no_ray")

MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"


def _files(arithmetic_files, *extra):
    train, test = arithmetic_files
    return [f"data.train_files=[{train}]", f"data.val_files=[{test}]", *extra]


@pytest.mark.parametrize(
    "extra, key, message",
    [
        (
            [f"{MULTI_TURN}.enable=true", "actor_rollout_ref.rollout.name=hf"],
            "actor_rollout_ref.rollout.name",
            "hf has no such API",
        ),
        (
            [
                f"{MULTI_TURN}.enable=true",
                "actor_rollout_ref.actor.tensor_model_parallel_size=2",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            ],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "generates on one rank",
        ),
        ([f"{MULTI_TURN}.enable=true", f"{MULTI_TURN}.format=xml"], f"{MULTI_TURN}.format", "'xml' is not a known"),
        (
            [f"{MULTI_TURN}.enable=true", f"{MULTI_TURN}.default_agent=wizard"],
            f"{MULTI_TURN}.default_agent",
            "no agent loop named 'wizard'",
        ),
        (
            [f"{MULTI_TURN}.enable=true", f"{MULTI_TURN}.tool_config_path=/no/tools.yaml"],
            f"{MULTI_TURN}.tool_config_path",
            "does not exist",
        ),
        ([f"{MULTI_TURN}.max_assistant_turns=0"], f"{MULTI_TURN}.max_assistant_turns", "positive"),
    ],
)
def test_bad_multi_turn_settings_fail_before_ray(arithmetic_files, extra, key, message):
    with pytest.raises(ConfigError, match=message) as caught:
        run(load_config(_files(arithmetic_files, *extra)))
    assert caught.value.key == key
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def calculator_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("calculator")
    rows = make_task_rows("calculator", 16, "train", 0)
    return write_rows(rows, out / "train.parquet"), write_rows(rows[:4], out / "test.parquet")


def test_data_that_names_agent_loops_needs_multi_turn_on(calculator_files):
    with pytest.raises(ConfigError, match="multi-turn rollout is off") as caught:
        run(load_config(_files(calculator_files, "data.max_prompt_length=512")))
    assert caught.value.key == f"{MULTI_TURN}.enable"
    assert not ray.is_initialized()


def test_an_unknown_agent_loop_in_the_data_is_named(calculator_files, tmp_path):
    rows = make_task_rows("calculator", 8, "train", 0)
    rows[3]["agent_name"] = "nope"
    path = write_rows(rows, tmp_path / "train.parquet")
    extra = ["data.max_prompt_length=512", f"{MULTI_TURN}.enable=true"]
    with pytest.raises(ConfigError, match="no agent loop named 'nope'"):
        run(load_config(_files((path, calculator_files[1]), *extra)))
    assert not ray.is_initialized()


def test_the_files_workers_read_become_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(
        [f"{MULTI_TURN}.tool_config_path=tools/calc.yaml", f"{MULTI_TURN}.default_agent=loops/mine.py:MyLoop"]
    )
    paths = make_run_plan(config).paths
    assert paths.tool_config == str(tmp_path / "tools" / "calc.yaml")
    assert paths.default_agent == f"{tmp_path / 'loops' / 'mine.py'}:MyLoop"
    multi_turn = config.actor_rollout_ref.rollout.multi_turn  # the config itself stays as it was loaded
    assert (multi_turn.tool_config_path, multi_turn.default_agent) == ("tools/calc.yaml", "loops/mine.py:MyLoop")
