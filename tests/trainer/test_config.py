"""The config: the YAML holds every default and the schema none, overrides, and each class of bad
config fails before Ray starts, named by the key the user typed."""

import dataclasses
import typing

import pytest
import ray
import yaml
from omegaconf import OmegaConf

from hybridflow.models import resolve_model_path
from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.check_config import check_config
from hybridflow.trainer.setup.config import DEFAULT_CONFIG, ConfigError, HybridFlowConfig, default_config, load_config

# checks that nothing started Ray, or runs that start and end their own cluster: the shared one (tests/conftest.py)
# is shut down first
pytestmark = pytest.mark.usefixtures("no_ray")


def schema_tree(cls: type) -> dict:
    """Field names of a config dataclass, nested sections as dicts (what the YAML must spell out)."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: schema_tree(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None
        for f in dataclasses.fields(cls)
    }


def key_tree(node: dict, schema: dict) -> dict:
    """The YAML's keys in the same shape (a value that is a dict where the schema has a section)."""
    return {k: key_tree(v, schema.get(k) or {}) if isinstance(schema.get(k), dict) else None for k, v in node.items()}


def config_classes(cls: type) -> set[type]:
    hints = typing.get_type_hints(cls)
    nested = [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return {cls}.union(*(config_classes(c) for c in nested))


def test_the_yaml_gives_every_field_a_value_and_no_other_key():
    schema = schema_tree(HybridFlowConfig)
    with open(DEFAULT_CONFIG) as file:
        assert key_tree(yaml.safe_load(file), schema) == schema


def test_defaults_are_written_once_in_the_yaml_and_configs_are_built_by_keyword():
    classes = config_classes(HybridFlowConfig)
    assert len(classes) >= 15  # every section and subsection
    for cls in classes:
        for field in dataclasses.fields(cls):
            where = f"{cls.__name__}.{field.name}"
            assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING, where
            assert field.kw_only, where


def test_default_config_reads_the_yaml():
    config = default_config()
    yaml_values = OmegaConf.load(DEFAULT_CONFIG)
    assert config.algorithm.gamma == yaml_values.algorithm.gamma
    assert config.actor_rollout_ref.rollout.val_kwargs.do_sample is False  # validation's own settings
    assert config.actor_rollout_ref.rollout.do_sample is True
    assert config.critic.optim.lr == 1e-5 and config.actor_rollout_ref.actor.optim.lr == 1e-6


def test_a_config_file_changes_only_the_keys_it_names(tmp_path):
    partial = tmp_path / "run.yaml"
    partial.write_text("algorithm:\n  lam: 0.9\nactor_rollout_ref:\n  rollout:\n    n: 3\n")
    config = load_config(["algorithm.gamma=0.5"], config_file=partial)
    defaults = default_config()
    assert (config.algorithm.lam, config.actor_rollout_ref.rollout.n, config.algorithm.gamma) == (0.9, 3, 0.5)
    config.algorithm.lam, config.actor_rollout_ref.rollout.n, config.algorithm.gamma = 1.0, 4, 1.0
    assert config == defaults


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
        # a value its section rejects, named by the full key
        ("algorithm.gamma=1.5", "algorithm.gamma", "must be in \\[0, 1\\]"),
        ("algorithm.kl_ctrl.type=linear", "algorithm.kl_ctrl.type", "adaptive, fixed"),
        ("algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon", "positive"),
        (
            "actor_rollout_ref.actor.policy_loss.clip_ratio_c=0.5",
            "actor_rollout_ref.actor.policy_loss.clip_ratio_c",
            "> 1",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.clip_ratio_low=-0.1",
            "actor_rollout_ref.actor.policy_loss.clip_ratio_low",
            ">= 0",
        ),
        (
            "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu=0",
            "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",
            "positive",
        ),
        (
            "actor_rollout_ref.actor.optim.lr_scheduler=linear",
            "actor_rollout_ref.actor.optim.lr_scheduler",
            "constant, cosine",
        ),
        ("critic.fsdp.param_dtype=int8", "critic.fsdp.param_dtype", "bf16"),
        ("actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.temperature", "do_sample=false"),
        ("actor_rollout_ref.rollout.val_kwargs.top_p=0", "actor_rollout_ref.rollout.val_kwargs.top_p", "\\(0, 1\\]"),
        ("actor_rollout_ref.rollout.top_k=0", "actor_rollout_ref.rollout.top_k", "-1 \\(off\\) or positive"),
        ("actor_rollout_ref.rollout.val_kwargs.n=0", "actor_rollout_ref.rollout.val_kwargs.n", "positive"),
        (
            "actor_rollout_ref.rollout.native.max_num_seqs=0",
            "actor_rollout_ref.rollout.native.max_num_seqs",
            "positive",
        ),
        (
            "actor_rollout_ref.rollout.old_log_prob_source=cache",
            "actor_rollout_ref.rollout.old_log_prob_source",
            "auto, recompute, rollout",
        ),
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=0",
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "positive",
        ),
        ("data.val_batch_size=0", "data.val_batch_size", "positive"),
        ("trainer.total_training_steps=0", "trainer.total_training_steps", "-1"),
        ("trainer.device=tpu", "trainer.device", "cpu, cuda"),
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
            "do not split over the 3 data-parallel ranks",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"],
            "critic.ppo_mini_batch_size",
            "does not divide",
        ),
        (["actor_rollout_ref.model.path=/no/such/model"], "actor_rollout_ref.model.path", "neither a built-in model"),
        (["reward_model.enable=true"], "reward_model.model.path", "no model is given"),
        (["reward_model.replace_rule_reward=true"], "reward_model.replace_rule_reward", "no reward model to replace"),
        (["custom_reward_function.path=/no/such.py"], "custom_reward_function.path", "does not exist"),
        (["trainer.logger=[console,neptune]"], "trainer.logger", "neptune"),
        (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name", "sglang"),
        (  # tiny-llama's heads are 16 wide; vLLM's CPU kernels start at 32
            ["actor_rollout_ref.rollout.name=vllm"],
            "actor_rollout_ref.rollout.name",
            r"vllm cannot run tiny-llama: vLLM's CPU attention takes head sizes \[32, .*this model's is 16",
        ),
        (  # vLLM 0.32 reads Mixtral's experts by transformers 4's names
            ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.path=tiny-mixtral"],
            "actor_rollout_ref.rollout.name",
            r"(?s)vllm cannot load tiny-mixtral: .*transformers 5 writes them fused.*rollout.name=native or hf",
        ),
        (
            ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "needs a tensor-parallel backend",
        ),
        (["actor_rollout_ref.rollout.vllm.kv_cache_gb=0"], "actor_rollout_ref.rollout.vllm.kv_cache_gb", "positive"),
        (["algorithm.gamma=1.5"], "algorithm.gamma", "must be in"),
        (
            ["algorithm.adv_estimator=pass_at_k", "algorithm.pass_k=4"],
            "algorithm.adv_estimator",
            "not below rollout.n=4",
        ),
        (["trainer.resume_mode=/no/such/global_step_3"], "trainer.resume_mode", "global_step_3: it does not exist"),
        (
            [
                "actor_rollout_ref.actor.tensor_model_parallel_size=2",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            ],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "does not divide actor.tensor_model_parallel_size=2",
        ),
        (
            ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "needs a tensor-parallel backend",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.tensor_model_parallel_size=3"],
            "critic.tensor_model_parallel_size",
            "does not divide the 2 ranks of pool",
        ),
        (
            ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.tensor_model_parallel_size=4"],
            "actor_rollout_ref.ref.tensor_model_parallel_size",
            "does not divide the 2 ranks of pool",
        ),
        (
            ["trainer.n_workers_per_node=4", "algorithm.adv_estimator=gae", "critic.tensor_model_parallel_size=4"],
            "critic.tensor_model_parallel_size",
            "num_key_value_heads",
        ),
        (  # tiny-llama has 2 key/value heads: 4 ranks cannot each hold whole ones
            ["trainer.n_workers_per_node=4", "actor_rollout_ref.actor.tensor_model_parallel_size=4"],
            "actor_rollout_ref.actor.tensor_model_parallel_size",
            "num_key_value_heads",
        ),
        (
            ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"],
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "does not divide the 2 ranks of pool",
        ),
        (  # tiny-llama has 4 query heads: 8 ranks cannot each attend with whole ones
            ["trainer.n_workers_per_node=8", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8"],
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "more ranks than the model's 4 attention heads",
        ),
        (  # 2 tensor-parallel ranks leave each 2 of the 4 heads: too few for 4 sequence-parallel ranks
            [
                "trainer.n_workers_per_node=8",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
                "actor_rollout_ref.actor.tensor_model_parallel_size=2",
            ],
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "2 attention heads per tensor-parallel rank",
        ),
        (
            [
                "algorithm.adv_estimator=gae",
                "critic.ulysses_sequence_parallel_size=2",
                "critic.use_remove_padding=false",
            ],
            "critic.ulysses_sequence_parallel_size",
            "set critic.use_remove_padding=true",
        ),
        (
            ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=3"],
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
            "does not divide the 2 ranks of pool",
        ),
        (["teacher.model.path=/no/such/teacher"], "teacher.model.path", "neither a built-in model"),
        # a teacher of another tokenizer: tests/models/test_tokenizer_match.py (tiny-qwen2 shares tiny-llama's)
        (
            ["teacher.model.path=tiny-llama", "algorithm.filter_groups.enable=true"],
            "algorithm.filter_groups.enable",
            "the rewards are not in the advantage",
        ),
        (
            ["teacher.model.path=tiny-llama", "algorithm.distillation.coef=0", "algorithm.distillation.reward_coef=0"],
            "algorithm.distillation.coef",
            "both 0",
        ),
    ],
)
def test_each_bad_config_fails_clearly_without_starting_ray(arithmetic_files, extra, key, message):
    with pytest.raises(ConfigError, match=message) as caught:
        run(load_config(valid(arithmetic_files, *extra)))
    assert caught.value.key == key
    assert not ray.is_initialized()


def test_vllm_on_cpu_needs_a_step_budget_of_a_whole_sequence(arithmetic_files):
    head_32 = resolve_model_path("tiny-llama", num_attention_heads=2, num_key_value_heads=1)
    vllm = ["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={head_32}"]
    extra = [*vllm, "actor_rollout_ref.rollout.vllm.max_num_batched_tokens=512"]
    with pytest.raises(ConfigError, match="below the longest sequence") as caught:
        run(load_config(valid(arithmetic_files, *extra)))
    assert caught.value.key == "actor_rollout_ref.rollout.vllm.max_num_batched_tokens"
    check_config(load_config(valid(arithmetic_files, *extra, "actor_rollout_ref.rollout.vllm.max_model_len=512")))
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


def test_one_sample_per_prompt_is_refused_only_when_the_group_advantage_is_trained_on(arithmetic_files):
    """With a teacher and reward_coef=0 the teacher gives the whole advantage: rollout.n=1 learns. Once the task
    reward's GRPO advantage is mixed in, one sample per prompt makes that part 0 and is refused."""
    distill = ["teacher.model.path=tiny-llama", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=8"]
    check_config(load_config(valid(arithmetic_files, *distill)))
    with pytest.raises(ConfigError, match="compares the samples of a prompt") as caught:
        check_config(load_config(valid(arithmetic_files, *distill, "algorithm.distillation.reward_coef=0.5")))
    assert caught.value.key == "actor_rollout_ref.rollout.n"
