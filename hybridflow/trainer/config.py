"""The whole run's config: typed dataclasses, filled from the YAML default and ``key=value`` overrides.

The dataclasses are the schema (one line of help per field). ``config/ppo_trainer.yaml`` is the
default a user reads and copies; a test keeps it equal to the dataclass defaults.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from hybridflow.engine.config import CriticConfig
from hybridflow.workers.config import ActorRolloutRefConfig, RewardModelConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "ppo_trainer.yaml"


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet/jsonl files of training prompts
    val_files: list[str] = field(default_factory=list)  # held-out prompts for validation (empty: no validation)
    train_batch_size: int = 8  # prompts per training step (each sampled rollout.n times)
    val_batch_size: int = 64  # prompts per validation generation call
    max_prompt_length: int = 256  # longest templated prompt in tokens
    filter_overlong_prompts: bool = True  # drop longer prompts (counted in the log); false: stop with an error
    prompt_key: str = "prompt"  # column holding the chat messages
    shuffle: bool = True  # shuffle training prompts each epoch (seeded by trainer.seed)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive (Ziegler et al. 2019)
    kl_coef: float = 0.001  # initial (fixed: constant) coefficient of the KL penalty in the reward
    target_kl: float = 0.1  # adaptive: the KL per sequence the controller steers towards
    horizon: int = 10000  # adaptive: samples over which the coefficient adapts


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | opo | gpg | grpo_passk
    gamma: float = 1.0  # discount factor
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # false: Dr.GRPO (no division by the group std)
    epsilon: float = 1e-6  # added to standard deviations before dividing
    gae_whiten: bool = True  # whiten GAE advantages over the batch
    pass_k: int = 4  # k of grpo_passk
    gpg_norm_by_std: bool = False  # GPG's optional std normalisation
    use_kl_in_reward: bool = False  # subtract beta * KL(pi || ref) from the per-token reward
    kl_penalty: str = "kl"  # KL estimator used in the reward
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: str = ""  # a Python file with the scoring function ("" : built-in scorers by data_source)
    name: str = (
        "compute_score"  # the function's name: (data_source, solution_str, ground_truth, extra_info) -> float | dict
    )


@dataclass
class TrainerConfig:
    project_name: str = "hybridflow"  # groups runs in the output directory and loggers
    experiment_name: str = "run"  # this run's name
    total_epochs: int = 1  # passes over the training prompts
    total_training_steps: int = -1  # stop after this many steps (-1: total_epochs worth)
    nnodes: int = 1  # Ray nodes to use
    n_workers_per_node: int = 2  # worker processes (ranks) per node; GPUs per node on CUDA
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)
    cpus_per_worker: float = 1.0  # CPUs reserved per rank in the Ray placement group
    threads_per_worker: int = 0  # torch threads per rank (0: cpus_per_worker)
    ray_address: str = ""  # join this Ray cluster ("": start a local one)
    ray_num_cpus: int = 0  # logical CPUs of a local Ray cluster (0: max(cores, 8))
    logger: list[str] = field(
        default_factory=lambda: ["console", "jsonl"]
    )  # console | jsonl | tensorboard | wandb | mlflow
    val_before_train: bool = True  # validate once before the first step
    test_freq: int = -1  # validate every N steps (-1: only before training and at the end)
    save_freq: int = -1  # checkpoint every N steps and after the last one (-1: never)
    max_ckpt_to_keep: int = -1  # keep only the newest N checkpoints (-1: all)
    resume_mode: str = (
        "auto"  # auto (latest complete checkpoint in default_local_dir, if any) | disable | a global_step_N path
    )
    default_local_dir: str = (
        "runs/${trainer.project_name}/${trainer.experiment_name}"  # the run's directory: metrics, config, checkpoints
    )
    critic_warmup: int = 0  # steps that train only the critic before the actor starts
    seed: int = 0  # seeds data order, sampling and initialisation


@dataclass
class HybridFlowConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_workers_per_node


class ConfigError(ValueError):
    """A config problem, named by its key, with what would fix it."""

    def __init__(self, key: str, problem: str, fix: str = ""):
        self.key = key
        super().__init__(f"config key '{key}': {problem}" + (f"\n  fix: {fix}" if fix else ""))


def _known_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        full = f"{prefix}{key}"
        keys.append(full)
        if OmegaConf.is_dict(value):
            keys.extend(_known_keys(value, full + "."))
    return keys


def _explain(error: OmegaConfBaseException, schema) -> ConfigError:
    key = getattr(error, "full_key", None) or "?"
    if isinstance(error, ConfigKeyError):
        close = difflib.get_close_matches(key, _known_keys(schema), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see hybridflow/config/ppo_trainer.yaml for the keys"
        return ConfigError(key, "no such key", hint)
    return ConfigError(key, str(error).splitlines()[0], "give a value of the field's type (see ppo_trainer.yaml)")


def load_config(overrides: list[str] | None = None, config_file: str | Path | None = None) -> HybridFlowConfig:
    """Schema <- YAML file (the default one unless given) <- ``key=value`` overrides, as typed dataclasses."""
    schema = OmegaConf.structured(HybridFlowConfig)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.load(config_file or DEFAULT_CONFIG))
        for override in overrides or []:
            if "=" not in override:
                raise ConfigError(override, "an override must look like key=value", "e.g. data.train_batch_size=16")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([override]))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise _explain(error, schema) from None


def to_yaml(config: HybridFlowConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
