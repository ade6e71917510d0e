"""The config: YAML default equals the schema, overrides, and each class of bad config fails before Ray starts."""

from dataclasses import asdict

import pytest
import ray
from omegaconf import OmegaConf

from hybridflow.trainer.check_config import check_config
from hybridflow.trainer.config import DEFAULT_CONFIG, ConfigError, HybridFlowConfig, load_config
from hybridflow.trainer.main import run


def test_yaml_default_is_exactly_the_schema_defaults():
    assert OmegaConf.to_container(OmegaConf.load(DEFAULT_CONFIG)) == asdict(HybridFlowConfig())


def test_overrides_fill_typed_fields():
    config = load_config(
        ["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=3", "data.train_files=[a.parquet,b.jsonl]"]
    )
    assert config.algorithm.adv_estimator == "rloo" and config.actor_rollout_ref.rollout.n == 3
    assert config.data.train_files == ["a.parquet", "b.jsonl"]


@pytest.mark.parametrize(
    "override, key, message",
    [
        (
            "actor_rollout_ref.actor.ppo_mini_batch=4",
            "actor_rollout_ref.actor.ppo_mini_batch",
            "did you mean actor_rollout_ref.actor.ppo_mini_batch_size",
        ),
        ("data.train_batch_size=many", "data.train_batch_size", "could not be converted to Integer"),
        ("trainer", "trainer", "key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, key, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config([override])
    assert caught.value.key == key


def valid(arithmetic_files, *extra: str) -> list[str]:
    train, test = arithmetic_files
    return [f"data.train_files=[{train}]", f"data.val_files=[{test}]", *extra]


@pytest.mark.parametrize(
    "extra, key, message",
    [
        (["data.train_files=[]"], "data.train_files", "no files given"),
        (["data.train_files=[/no/such/file.parquet]"], "data.train_files", "does not exist"),
        (["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator", "grpo"),
        (
            ["actor_rollout_ref.actor.policy_loss.loss_mode=clipped"],
            "actor_rollout_ref.actor.policy_loss.loss_mode",
            "vanilla",
        ),
        (["actor_rollout_ref.actor.loss_agg_mode=mean"], "actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
        (["actor_rollout_ref.actor.kl_loss_type=k9"], "actor_rollout_ref.actor.kl_loss_type", "low_var_kl"),
        (
            ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "does not divide",
        ),
        (
            ["trainer.n_workers_per_node=3", "actor_rollout_ref.rollout.n=1"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "do not split over 3 ranks",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"],
            "critic.ppo_mini_batch_size",
            "does not divide",
        ),
        (["actor_rollout_ref.model.path=/no/such/model"], "actor_rollout_ref.model.path", "neither a built-in model"),
        (["reward_model.enable=true"], "reward_model.model.path", "no model is given"),
        (["custom_reward_function.path=/no/such.py"], "custom_reward_function.path", "does not exist"),
        (["trainer.logger=[console,neptune]"], "trainer.logger", "neptune"),
        (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name", "sglang"),
        (["algorithm.gamma=1.5"], "algorithm", "gamma"),
        (["trainer.resume_mode=/no/such/global_step_3"], "trainer.resume_mode", "not a complete checkpoint"),
    ],
)
def test_each_bad_config_fails_clearly_without_starting_ray(arithmetic_files, extra, key, message):
    config = load_config(valid(arithmetic_files, *extra))
    with pytest.raises(ConfigError, match=message) as caught:
        run(config)
    assert caught.value.key == key
    assert not ray.is_initialized()


def test_custom_reward_without_the_named_function(arithmetic_files, tmp_path):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    config = load_config(valid(arithmetic_files, f"custom_reward_function.path={reward_file}"))
    with pytest.raises(ConfigError, match="defines no 'compute_score'") as caught:
        check_config(config)
    assert caught.value.key == "custom_reward_function.name"


def test_a_valid_config_passes(arithmetic_files):
    check_config(load_config(valid(arithmetic_files)))
