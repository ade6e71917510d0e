"""The DPO trainer's config: its sections' typed dataclasses, composed, filled from dpo_trainer.yaml.

``model``, ``engine``, ``optim`` and ``trainer`` are SFT's sections (a DPO step is an SFT step with another loss and a
reference pass); ``data`` reads preference pairs, and ``algorithm`` is the pair loss. Defaults are written once, in
hybridflow/config/dpo_trainer.yaml; loading, overrides and errors are RL's (trainer/setup/config.py
``load_config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridflow.algorithms.preference import PreferenceConfig
from hybridflow.data import PreferenceDataConfig
from hybridflow.engine.config import SFTEngineConfig
from hybridflow.engine.optim import OptimConfig
from hybridflow.trainer.setup.config import RunConfig, load_config
from hybridflow.trainer.setup.sft_config import SFTModelConfig

DPO_DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "dpo_trainer.yaml"


@dataclass(kw_only=True)
class DPOConfig:
    data: PreferenceDataConfig  # the files of pairs, how rows become pairs, batch sizes in pairs
    model: SFTModelConfig  # the model to train (a local Hugging Face directory or a built-in name); also the reference
    algorithm: PreferenceConfig  # the pair loss: DPO (sigmoid), IPO or hinge, its beta and label smoothing
    engine: SFTEngineConfig  # micro-batches (in rows: two per pair), packing, parallelism, clipping, FSDP2
    optim: OptimConfig  # AdamW and its learning-rate schedule
    trainer: RunConfig  # the run: its length, workers, Ray, logging, validation and checkpoints


def load_dpo_config(overrides: list[str] | None = None, config_file: str | Path | None = None) -> DPOConfig:
    """dpo_trainer.yaml <- ``config_file`` (if given) <- ``key=value`` overrides, as ``DPOConfig``."""
    return load_config(overrides, config_file, root=DPOConfig, defaults=DPO_DEFAULT_CONFIG)
