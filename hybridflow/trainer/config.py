"""The whole run's config: each component's typed dataclass, composed, filled from the YAML.

Every component owns one keyword-only dataclass for its section (one line of help per field,
its own checks in ``__post_init__``); ``HybridFlowConfig`` only composes them. Defaults are
written once, in ``hybridflow/config/ppo_trainer.yaml``: the dataclasses declare no default
values, and a key missing from the YAML is an error. A run's config is

    default YAML  <-  a user's YAML file (``--config``, any subset of keys)  <-  ``key=value`` overrides

and a value a component rejects is reported with the full key the user typed.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from hybridflow.algorithms import AlgorithmConfig
from hybridflow.data import DataConfig
from hybridflow.engine.config import CriticConfig
from hybridflow.reward import CustomRewardFunctionConfig, RewardConfig
from hybridflow.trainer.tracking import KNOWN_LOGGERS
from hybridflow.validation import (
    ConfigError,
    InputFileError,
    InvalidSetting,
    reading_file,
    require,
    require_choice,
    require_positive,
)
from hybridflow.workers.config import ActorRolloutRefConfig, RewardModelConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "ppo_trainer.yaml"
DEVICES = ("cpu", "cuda")  # cpu: gloo collectives; cuda: nccl
PLACEMENTS = ("all_colocate", "group_colocate", "separate", "custom")  # see trainer/placement.py
ASYNC_MODES = ("sync", "one_step_off")  # see trainer/one_step_off.py


@dataclass(kw_only=True)
class AsyncTrainingConfig:
    """Generation on a pool of its own (the rollout role), overlapping the actor's training."""

    # sync (generate, then train, both on the actor's pool) | one_step_off (the rollout role generates the batch of
    # step k+1 with the weights of step k-1 while the actor trains step k; trainer/one_step_off.py)
    mode: str
    transfer_bucket_mb: float  # new weights go from the actor's pool to the rollout's in messages of at most this size
    # a weight transfer (or the start of its group) that does not finish in this time stops the run with an error
    # naming both sides, instead of hanging
    transfer_timeout_s: float

    def __post_init__(self) -> None:
        require_choice(self.mode, ASYNC_MODES, "mode")
        require_positive(self.transfer_bucket_mb, "transfer_bucket_mb")
        require_positive(self.transfer_timeout_s, "transfer_timeout_s")

    @property
    def rollout_apart(self) -> bool:
        """Whether generation runs on the rollout role's pool instead of the actor's (every mode but sync)."""
        return self.mode != "sync"


@dataclass(kw_only=True)
class TrainerConfig:
    """The run: its length, workers and devices, Ray, logging, validation and checkpoints."""

    project_name: str  # groups runs in the output directory and loggers
    experiment_name: str  # this run's name
    total_epochs: int  # passes over the training prompts
    total_training_steps: int  # stop after this many steps (-1: total_epochs worth)
    nnodes: int  # Ray nodes to use
    n_workers_per_node: int  # worker processes (ranks) per node; GPUs per node on CUDA
    device: str  # cpu (gloo) | cuda (nccl)
    cpus_per_worker: float  # CPUs reserved per rank in the Ray placement group
    threads_per_worker: int  # torch threads per rank (0: cpus_per_worker, at least 1)
    placement: str  # all_colocate | group_colocate (actor+ref, critic+reward model, rollout) | separate | custom
    resource_pool_spec: dict[str, list[int]]  # custom: pool name -> processes per node, e.g. {actor: [2], critic: [1]}
    role_pool: dict[str, str]  # custom: role (actor_rollout | ref | critic | reward_model | rollout) -> pool name
    max_colocate_count: int  # Ray actors that may share one rank's resources (a rank's roles are fused into one)
    placement_timeout_s: float  # how long to wait for Ray to place the worker groups before failing
    ray_address: str  # join this Ray cluster ("": start a local one)
    # compiled CPU kernels a worker keeps per input shape (oneDNN's and ideep's caches; 1024 by default): packed batches
    # change shape every step, so larger caches grow memory for ~1000 shapes (bench/memory.py)
    cpu_kernel_cache_capacity: int
    ray_num_cpus: int  # logical CPUs of a local Ray cluster (0: the machine's cores, or what the workers reserve)
    logger: list[str]  # any of: console | jsonl | tensorboard | wandb | mlflow
    val_before_train: bool  # validate once before the first step
    test_freq: int  # validate every N steps (-1: only before training and at the end)
    save_freq: int  # checkpoint every N steps and after the last one (-1: never)
    max_ckpt_to_keep: int  # keep only the newest N checkpoints (-1: all)
    resume_mode: str  # auto (latest complete checkpoint in default_local_dir, if any) | disable | a global_step_N path
    default_local_dir: str  # the run's directory: metrics, config, checkpoints
    critic_warmup: int  # steps that train only the critic before the actor starts
    seed: int  # seeds data order, sampling and initialisation
    async_training: AsyncTrainingConfig

    def __post_init__(self) -> None:
        require_positive(self.total_epochs, "total_epochs")
        require(
            self.total_training_steps == -1 or self.total_training_steps > 0,
            "total_training_steps",
            f"must be positive or -1 (total_epochs worth), got {self.total_training_steps}",
        )
        require_positive(self.nnodes, "nnodes")
        require_positive(self.n_workers_per_node, "n_workers_per_node")
        require_choice(self.device, DEVICES, "device")
        require_positive(self.cpus_per_worker, "cpus_per_worker")
        require(self.threads_per_worker >= 0, "threads_per_worker", f"must be >= 0, got {self.threads_per_worker}")
        require_choice(self.placement, PLACEMENTS, "placement")
        require(
            self.placement == "custom" or not (self.resource_pool_spec or self.role_pool),
            "placement",
            f"resource_pool_spec / role_pool are read only with placement=custom, but placement={self.placement}",
            "set trainer.placement=custom, or drop the pools",
        )
        require_positive(self.max_colocate_count, "max_colocate_count")
        require_positive(self.placement_timeout_s, "placement_timeout_s")
        require(
            self.cpu_kernel_cache_capacity >= 1,
            "cpu_kernel_cache_capacity",
            f"must be >= 1 (torch's ideep cache crashes at 0), got {self.cpu_kernel_cache_capacity}",
        )
        require(self.ray_num_cpus >= 0, "ray_num_cpus", f"must be >= 0, got {self.ray_num_cpus}")
        for name in self.logger:
            require_choice(name, KNOWN_LOGGERS, "logger")
        for name in ("test_freq", "save_freq", "max_ckpt_to_keep"):
            value = getattr(self, name)
            require(value == -1 or value > 0, name, f"must be positive or -1 (off), got {value}")
        require(bool(self.resume_mode), "resume_mode", "must be auto, disable or a global_step_N directory")
        require(self.critic_warmup >= 0, "critic_warmup", f"must be >= 0, got {self.critic_warmup}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_workers_per_node


@dataclass(kw_only=True)
class HybridFlowConfig:
    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig
    reward_model: RewardModelConfig
    custom_reward_function: CustomRewardFunctionConfig
    reward: RewardConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig

    @property
    def world_size(self) -> int:
        return self.trainer.world_size


def _known_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        full = f"{prefix}{key}"
        keys.append(full)
        if OmegaConf.is_dict(value):
            keys.extend(_known_keys(value, full + "."))
    return keys


def _explain(error: OmegaConfBaseException) -> ConfigError:
    key = getattr(error, "full_key", None) or "?"
    if isinstance(error, ConfigKeyError):
        close = difflib.get_close_matches(key, _known_keys(OmegaConf.load(DEFAULT_CONFIG)), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see hybridflow/config/ppo_trainer.yaml for the keys"
        return ConfigError(key, "no such key", hint)
    if isinstance(error, MissingMandatoryValue):
        return ConfigError(key, "has no value", f"give one ({DEFAULT_CONFIG.name} holds every default)")
    return ConfigError(key, str(error).splitlines()[0], "give a value of the field's type (see ppo_trainer.yaml)")


def build(cls: type, values: dict, prefix: str = ""):
    """The dataclass ``cls`` from plain ``values``, nested sections first. A value a section rejects
    (InvalidSetting from its ``__post_init__``) becomes a ConfigError naming the full key."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        value = values[field.name]
        if dataclasses.is_dataclass(hints[field.name]):
            value = build(hints[field.name], value, f"{prefix}{field.name}.")
        kwargs[field.name] = value
    try:
        return cls(**kwargs)
    except InvalidSetting as error:
        raise ConfigError(prefix + error.field, error.problem, error.fix) from None


def _config_file(path: str | Path) -> DictConfig:
    """A user's --config file: YAML mapping the keys it changes."""
    with reading_file(path, key="--config", fix="give a YAML file of the keys it changes (as in examples/)"):
        node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise InputFileError(path, "is not a mapping of config keys", "write it as in examples/", key="--config")
    return node


def _override(override: str) -> DictConfig:
    """One ``key=value`` (the value in YAML syntax)."""
    key, equals, value = override.partition("=")
    if not equals:
        raise ConfigError(override, "an override must look like key=value", "e.g. data.train_batch_size=16")
    try:
        return OmegaConf.from_dotlist([override])
    except yaml.YAMLError as error:
        problem = " ".join(str(error).split())[:200]
        raise ConfigError(
            key, f"{value!r} is not a YAML value ({problem})", "quote it, or close its brackets"
        ) from None


def load_config(overrides: list[str] | None = None, config_file: str | Path | None = None) -> HybridFlowConfig:
    """The default YAML <- ``config_file`` (if given) <- ``key=value`` overrides, as typed dataclasses."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(HybridFlowConfig), OmegaConf.load(DEFAULT_CONFIG))
        if config_file is not None:
            merged = OmegaConf.merge(merged, _config_file(config_file))
        for override in overrides or []:
            merged = OmegaConf.merge(merged, _override(override))
        values = OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as error:
        raise _explain(error) from None
    return build(HybridFlowConfig, values)


def config_sections() -> list[tuple[str, str]]:
    """(top-level key, the first line of its dataclass's docstring), for ``hybridflow train --help``."""
    hints = typing.get_type_hints(HybridFlowConfig)
    return [
        (f.name, (hints[f.name].__doc__ or "").strip().splitlines()[0]) for f in dataclasses.fields(HybridFlowConfig)
    ]


def default_config() -> HybridFlowConfig:
    """Every default, as the typed config (a fresh copy each call): for code and tests that build
    one component, e.g. ``default_config().actor_rollout_ref.actor``."""
    return load_config()


def to_yaml(config: HybridFlowConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
