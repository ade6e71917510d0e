"""The fault suite: bad input fails before Ray starts, as one message naming the key or file with exit
code 2 (damaged checkpoints, another run's directory and repeated runs: test_run_dir_faults.py)."""

import subprocess
import sys
import time

import pytest
import ray
from cache_helpers import built_models

from hybridflow.cli import main as cli

# checks that nothing started Ray (the shared cluster of tests/conftest.py is not running) and that no model is built
pytestmark = pytest.mark.usefixtures("no_ray")


CUSTOM_REWARDS = {
    "raises": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1 / 0\n",
    "nan": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n",
    "inf": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('inf')\n",
    "none": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return None\n",
    "string": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 'good'\n",
    "signature": "def compute_score(solution_str):\n    return 1.0\n",
}


def base(files, run_dir) -> list[str]:
    train, test = files
    return [
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
    ]


@pytest.fixture(autouse=True)
def _fresh_machine(empty_model_cache):
    """Each command here starts with an empty model cache, as on a fresh machine, and must leave it empty: its
    error comes before any model is converted."""
    yield
    assert built_models(empty_model_cache) == []


def fails_before_ray(args: list[str], capsys) -> str:
    """Runs ``hybridflow train`` in this process; it must exit with 2 before Ray starts and before a model is
    built, within 10 s, printing only its error."""
    start = time.perf_counter()
    code = cli(["train", *args])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert not ray.is_initialized()
    assert elapsed < 10, elapsed
    assert err.startswith("hybridflow: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["actor_rollout_ref.rollout.temperature=0"], "actor_rollout_ref.rollout.temperature"),
        (["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n': algorithm.adv_estimator=grpo"),
        (["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=rloo"], "adv_estimator=rloo compares"),
        (["actor_rollout_ref.rollout.top_p=1.5"], "actor_rollout_ref.rollout.top_p"),
        (["actor_rollout_ref.rollout.top_p=0"], "actor_rollout_ref.rollout.top_p"),
        (["actor_rollout_ref.rollout.top_k=0"], "actor_rollout_ref.rollout.top_k"),
        (["trainer.total_training_steps=0"], "trainer.total_training_steps"),
        (["trainer.nnodes=2"], "trainer.nnodes': 2 nodes asked for, but a local Ray cluster is this one machine"),
        (["trainer.cpus_per_worker=100"], "trainer.cpus_per_worker': each rank asks for 100.0 CPUs"),
        (["actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu=0"], "log_prob_micro_batch_size_per_gpu"),
        (["actor_rollout_ref.rollout.val_kwargs.n=0"], "actor_rollout_ref.rollout.val_kwargs.n"),
        (["data.val_batch_size=0"], "data.val_batch_size"),
        (["actor_rollout_ref.actor.policy_loss.clip_ratio=-0.2"], "actor_rollout_ref.actor.policy_loss.clip_ratio"),
        (["trainer.default_local_dir=/sys/hybridflow-run"], "trainer.default_local_dir': cannot write to /sys"),
        (["reward_model.model.path=tiny-llama"], "reward_model.enable': is false, so the reward model at"),
        (["critic.model.path=tiny-llama"], "algorithm.adv_estimator=grpo trains no critic, so critic.model.path="),
        (["data.train_files=[/no/such.parquet]"], "data.train_files': file '/no/such.parquet' does not exist"),
        (["no_such_section.key=1"], "no_such_section"),
        (
            ["trainer.placement=custom", "trainer.resource_pool_spec.a=[3]", "trainer.role_pool.actor_rollout=a"],
            "do not split over the 3 data-parallel ranks of pool 'a' (actor_rollout)",
        ),
        (["trainer.placement=custom"], "trainer.resource_pool_spec': placement=custom needs named pools"),
    ],
)
def test_bad_settings_fail_before_ray(arithmetic_files, tmp_path, capsys, extra, expected):
    err = fails_before_ray([*base(arithmetic_files, tmp_path / "run"), *extra], capsys)
    assert expected in err
    assert not (tmp_path / "run").exists()  # a refused run leaves nothing behind


@pytest.mark.parametrize("kind", sorted(CUSTOM_REWARDS))
def test_a_custom_reward_that_cannot_score_fails_before_ray(arithmetic_files, tmp_path, capsys, kind):
    reward = tmp_path / "reward.py"
    reward.write_text(CUSTOM_REWARDS[kind])
    err = fails_before_ray([*base(arithmetic_files, tmp_path / "run"), f"custom_reward_function.path={reward}"], capsys)
    assert "custom reward function (custom_reward_function.path / .name) failed on the first row" in err
    assert not (tmp_path / "run").exists()  # refused after the run directory's checks: nothing made


def test_a_data_source_without_a_scorer_fails_before_ray(tmp_path, capsys):
    from hybridflow.data.io import write_rows
    from hybridflow.data.tasks import make_task_rows

    rows = make_task_rows("arithmetic", 8, "train", 0)
    for row in rows[:3]:
        row["data_source"] = "my_unregistered_task"
    files = (write_rows(rows, tmp_path / "train.parquet"), write_rows(rows, tmp_path / "test.parquet"))
    err = fails_before_ray(base(files, tmp_path / "run"), capsys)
    assert "no reward scorer for data_source 'my_unregistered_task' (6 rows)" in err  # 3 in each file
    assert not (tmp_path / "run").exists()


def test_the_real_command_prints_one_message_and_exits_2(capsys):
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.trainer.commands.train", "actor_rollout_ref.rollout.top_k=0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hybridflow: error: config key 'actor_rollout_ref.rollout.top_k': must be -1 (off) or positive, got 0"
    ]
    # --debug adds the traceback (in this process: a second command would only import everything again)
    assert cli(["train", "--debug", "actor_rollout_ref.rollout.top_k=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.rstrip().endswith("must be -1 (off) or positive, got 0")


def test_help(capsys):
    assert cli(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: hybridflow train" in out
    for section in ("data", "actor_rollout_ref", "critic", "reward", "algorithm", "trainer"):
        assert f"\n  {section} " in out, section
    assert cli(["export", "--help"]) == 0 and "usage: hybridflow export" in capsys.readouterr().out
    assert cli(["export", "/no/such/run", "/tmp/out"]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


def test_a_joined_cluster_too_small_fails_before_placement():
    from ray.cluster_utils import Cluster

    from hybridflow.controller import start_ray
    from hybridflow.trainer.setup.cluster import check_cluster
    from hybridflow.trainer.setup.config import ConfigError, load_config
    from hybridflow.trainer.setup.run_plan import make_run_plan

    def check(overrides: list[str]) -> None:
        config = load_config(overrides)
        check_cluster(config.trainer, make_run_plan(config).placement)

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        assert start_ray(address=cluster.address)
        joined = [f"trainer.ray_address={cluster.address}"]
        check(joined)  # 1 node of 2 CPUs holds 2 ranks of 1 CPU
        start = time.perf_counter()
        with pytest.raises(ConfigError, match="2 nodes asked for; the Ray cluster .* has 1") as caught:
            check([*joined, "trainer.nnodes=2"])
        assert caught.value.key == "trainer.nnodes"
        with pytest.raises(ConfigError, match=r"up to 2 ranks \(all pools\) x 100.0 CPUs") as caught:
            check([*joined, "trainer.cpus_per_worker=100"])
        assert caught.value.key == "trainer.cpus_per_worker" and time.perf_counter() - start < 5
    finally:
        ray.shutdown()
        cluster.shutdown()
