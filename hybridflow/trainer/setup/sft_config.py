"""The SFT trainer's config: its sections' typed dataclasses, composed, filled from sft_trainer.yaml.

The sections that are the same thing as in RL are the same dataclasses: ``model`` is the trained model's
(path, gradient checkpointing, LoRA), ``optim`` AdamW's, and ``trainer`` the run's (``RunConfig``: length,
workers, Ray, loggers, validation, checkpoints, resume); ``data`` and ``engine`` are SFT's own. Defaults are
written once, in hybridflow/config/sft_trainer.yaml; loading, overrides and errors are RL's
(trainer/setup/config.py ``load_config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridflow.data import SFTDataConfig
from hybridflow.engine.config import SFTEngineConfig, TrainedModelConfig
from hybridflow.engine.optim import OptimConfig
from hybridflow.trainer.setup.config import RunConfig, load_config
from hybridflow.validation import require

SFT_DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "sft_trainer.yaml"


@dataclass(kw_only=True)
class SFTModelConfig(TrainedModelConfig):
    """The model to fine-tune: a local Hugging Face directory or a built-in name, optionally with LoRA."""

    def __post_init__(self) -> None:
        require(bool(self.path), "path", "no model given", "a local Hugging Face directory or a built-in name")


@dataclass(kw_only=True)
class SFTConfig:
    data: SFTDataConfig  # the files, how rows become samples, batch sizes
    model: SFTModelConfig  # the model to fine-tune (a local Hugging Face directory or a built-in name)
    engine: SFTEngineConfig  # micro-batches, packing, parallelism, clipping, FSDP2
    optim: OptimConfig  # AdamW and its learning-rate schedule
    trainer: RunConfig  # the run: its length, workers, Ray, logging, validation and checkpoints


def load_sft_config(overrides: list[str] | None = None, config_file: str | Path | None = None) -> SFTConfig:
    """sft_trainer.yaml <- ``config_file`` (if given) <- ``key=value`` overrides, as ``SFTConfig``."""
    return load_config(overrides, config_file, root=SFTConfig, defaults=SFT_DEFAULT_CONFIG)
