"""``hybridflow export <checkpoint> <out_dir>``: a checkpoint's actor as a plain Hugging Face model directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from hybridflow.engine.checkpoint import SHARDS


def consolidated_model_state(role_dir: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a role's DCP shards, read without a process group."""
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "state.pt"
        dcp_to_torch_save(str(role_dir / SHARDS), str(target))
        return torch.load(target, weights_only=False)["model"]


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write safetensors weights, config, generation config and tokenizer that ``from_pretrained`` loads."""
    role_dir = Path(checkpoint).expanduser() / "actor"
    hf_dir = role_dir / "huggingface"
    if not (role_dir / SHARDS).is_dir() or not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{checkpoint} has no actor checkpoint (expected actor/{SHARDS}/ and actor/huggingface/); "
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
