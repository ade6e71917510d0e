"""``hybridflow export <checkpoint|run_dir> <out_dir>``: a checkpoint's actor as a Hugging Face model directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from hybridflow.engine.checkpoint import SHARDS
from hybridflow.run_files import ACTOR_STATE, HF_FILES
from hybridflow.trainer.checkpoint import CheckpointManager, CheckpointNotFound


def consolidated_model_state(role_dir: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a role's DCP shards, read without a process group."""
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "state.pt"
        dcp_to_torch_save(str(role_dir / SHARDS), str(target))
        return torch.load(target, weights_only=False)["model"]


def _checkpoint_dir(path: Path) -> Path:
    """``path`` itself when it holds an actor checkpoint, else (a run directory) its latest complete one."""
    if (path / ACTOR_STATE).is_dir():
        return path
    latest = CheckpointManager(path).latest() if path.is_dir() else None
    if latest is None:
        raise CheckpointNotFound(
            f"{path} is neither a checkpoint (a global_step_N directory with actor/) nor a run directory with a "
            "complete checkpoint; give one of them"
        )
    return latest


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write safetensors weights, config, generation config and tokenizer that ``from_pretrained`` loads.

    ``checkpoint``: a global_step_N directory, or a run directory (its latest complete checkpoint)."""
    role_dir = _checkpoint_dir(Path(checkpoint).expanduser()) / ACTOR_STATE
    hf_dir = role_dir / HF_FILES
    if not (role_dir / SHARDS).is_dir() or not (hf_dir / "config.json").is_file():
        raise CheckpointNotFound(
            f"{role_dir.parent} has no complete actor checkpoint (expected actor/{SHARDS}/ and actor/huggingface/); "
            "give a global_step_N directory"
        )
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(consolidated_model_state(role_dir), strict=True)
    model.to(dtype)
    out = Path(out_dir).expanduser()
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    if (hf_dir / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(hf_dir).save_pretrained(out)
    return out
