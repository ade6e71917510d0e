"""The reward-model trainer's config: its sections' typed dataclasses, composed, filled from rm_trainer.yaml.

``model``, ``engine``, ``optim`` and ``trainer`` are SFT's sections (a reward-model step is an SFT step with a scalar
head and the Bradley-Terry loss); ``data`` reads preference pairs as DPO's does. Defaults are written once, in
hybridflow/config/rm_trainer.yaml; loading, overrides and errors are RL's (trainer/setup/config.py ``load_config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridflow.data import PreferenceDataConfig
from hybridflow.engine.config import SFTEngineConfig
from hybridflow.engine.optim import OptimConfig
from hybridflow.trainer.setup.config import RunConfig, load_config
from hybridflow.trainer.setup.sft_config import SFTModelConfig

RM_DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "rm_trainer.yaml"


@dataclass(kw_only=True)
class RMConfig:
    data: PreferenceDataConfig  # the files of pairs, how rows become pairs, batch sizes in pairs
    model: SFTModelConfig  # the backbone (a local Hugging Face directory or a built-in name); a scalar head is added
    engine: SFTEngineConfig  # micro-batches (in rows: two per pair), packing, parallelism, clipping, FSDP2
    optim: OptimConfig  # AdamW and its learning-rate schedule
    trainer: RunConfig  # the run: its length, workers, Ray, logging, validation and checkpoints


def load_rm_config(overrides: list[str] | None = None, config_file: str | Path | None = None) -> RMConfig:
    """rm_trainer.yaml <- ``config_file`` (if given) <- ``key=value`` overrides, as ``RMConfig``."""
    return load_config(overrides, config_file, root=RMConfig, defaults=RM_DEFAULT_CONFIG)
