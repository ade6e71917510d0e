"""``hybridflow export <checkpoint|run_dir> <out_dir>``: a checkpoint's actor as a Hugging Face model directory (a
causal LM; a reward model trained by ``hybridflow rm`` as a sequence classifier, which ``reward_model.path`` loads).

The checkpoint is verified before anything is read from it, as a resume does (trainer/services/checkpoint.py): a
damaged one named directly is one message naming it and what is wrong; a run directory exports its
newest intact checkpoint, with a warning naming the damaged ones skipped. Nothing is written to
``out_dir`` until the model has loaded.
"""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)

from hybridflow.engine.checkpoint import SHARDS
from hybridflow.engine.lora import ADAPTER
from hybridflow.models import load_causal_lm, load_reward_model
from hybridflow.models.loading import HEAD_NAME
from hybridflow.run_files import ACTOR_STATE, ADAPTER_FILES, HF_FILES
from hybridflow.trainer.services.checkpoint import STEP_DIR, CheckpointError, CheckpointManager, CheckpointNotFound
from hybridflow.trainer.services.checkpoint_check import (
    COMPLETE,
    MANIFEST,
    TRAINER_STATE,
    role_problems,
    warn_if_unverified,
)
from hybridflow.validation import UserError

HF_CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's names for an adapter directory's files
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# what reading a checkpoint's files raises when their bytes are not what they should be
UNREADABLE = (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError)


def consolidated_model_state(role_dir: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a role's DCP shards, read without a process group."""
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "state.pt"
        dcp_to_torch_save(str(role_dir / SHARDS), str(target))
        return torch.load(target, weights_only=False)["model"]


def _looks_like_checkpoint(path: Path) -> bool:
    return STEP_DIR.match(path.name) is not None or any(
        (path / name).exists() for name in (ACTOR_STATE, COMPLETE, TRAINER_STATE, MANIFEST)
    )


def find_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint, verified (CheckpointError naming what is wrong); else, a run
    directory, its newest intact checkpoint, with a warning naming the damaged ones skipped."""
    if path.is_dir() and _looks_like_checkpoint(path):
        found = role_problems(path)
        if (path / ACTOR_STATE).is_dir() and not (path / ACTOR_STATE / HF_FILES / HF_CONFIG).is_file():
            found.append(f"{ACTOR_STATE}/{HF_FILES}/{HF_CONFIG} is missing")
        if found:
            raise CheckpointError(f"cannot export {path}: {', '.join(found)}")
        warn_if_unverified(path)
        return path
    search = CheckpointManager(path).find_latest() if path.is_dir() else None
    if search is None or (search.checkpoint is None and not search.skipped):
        raise CheckpointNotFound(
            f"{path} is neither a checkpoint (a global_step_N directory with {ACTOR_STATE}/) nor a run directory "
            f"with a complete checkpoint{'' if path.is_dir() else ': it does not exist'}; give one of them"
        )
    if search.checkpoint is None:
        raise CheckpointError(
            f"nothing to export from {path}: every checkpoint in it is damaged: {search.describe_skipped()}"
        )
    for note in search.warnings("exporting from"):
        warnings.warn(note, stacklevel=2)
    warn_if_unverified(search.checkpoint)
    return search.checkpoint


def _error_text(error: BaseException) -> str:
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]  # DCP wraps each rank's error with its traceback
    text = " ".join(str(error).split()).split(". ")[0]  # one line; the first sentence (torch's go on with advice)
    return f"{type(error).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def has_score_head(names: Iterable[str]) -> bool:
    """Whether weights of these names are a reward model's (a sequence classifier's ``score`` head among them)."""
    return any(HEAD_NAME in name.split(".") for name in names)


def _load_actor(checkpoint: Path) -> PreTrainedModel:
    """The checkpoint's model: a causal LM, or a reward model (a sequence classifier) when it has a score head."""
    hf_dir = checkpoint / ACTOR_STATE / HF_FILES
    try:
        config = AutoConfig.from_pretrained(hf_dir)
        state = consolidated_model_state(checkpoint / ACTOR_STATE)
        auto_class = AutoModelForSequenceClassification if has_score_head(state) else AutoModelForCausalLM
        model = auto_class.from_config(config, dtype=torch.float32)
        model.load_state_dict(state, strict=True)
    except (*UNREADABLE, CheckpointException) as error:
        raise CheckpointError(
            f"cannot export {checkpoint}: its actor does not load, damaged or not hybridflow's ({_error_text(error)})"
        ) from error
    return model


def _adapter_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A LoRA actor's adapter weights under the names peft saves them by (no adapter name; a head trained whole, as
    a reward model's, under its own module's name)."""
    try:
        state = consolidated_model_state(checkpoint / ACTOR_STATE)
    except (*UNREADABLE, CheckpointException) as error:
        raise CheckpointError(
            f"cannot export {checkpoint}: its adapters do not load, damaged or not hybridflow's ({_error_text(error)})"
        ) from error
    return {
        name.replace(f".modules_to_save.{ADAPTER}.", ".").replace(f".{ADAPTER}.", "."): tensor.contiguous()
        for name, tensor in state.items()
    }


def _load_lora_actor(checkpoint: Path, adapter_out: Path) -> PreTrainedModel:
    """The base model with the checkpoint's adapters merged in (the adapter directory already written)."""
    from peft import PeftModel

    base = json.loads((adapter_out / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    load = load_reward_model if has_score_head(load_file(str(adapter_out / ADAPTER_WEIGHTS))) else load_causal_lm
    try:
        model = PeftModel.from_pretrained(load(base, dtype=torch.float32), str(adapter_out))
    except (*UNREADABLE, CheckpointException) as error:
        raise CheckpointError(
            f"cannot export {checkpoint}: its adapters do not fit {base} ({_error_text(error)})"
        ) from error
    return model.merge_and_unload()


def export_checkpoint(
    checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32, *, merged: bool = False
) -> Path:
    """Write safetensors weights, config, generation config and tokenizer that ``from_pretrained`` loads.

    ``checkpoint``: a global_step_N directory, or a run directory (its newest intact checkpoint). A damaged
    checkpoint, or an ``out_dir`` that cannot be written, is a UserError naming it. A LoRA actor's checkpoint
    exports as peft's adapter directory (``peft.PeftModel.from_pretrained`` loads it over the base model), or
    with ``merged`` as the base model with the adapters merged in."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"cannot export to {out}: it is a file, not a directory")
    source = find_checkpoint(Path(checkpoint).expanduser())
    print(f"exporting from {source}")
    adapter_config = source / ACTOR_STATE / ADAPTER_FILES / ADAPTER_CONFIG
    if adapter_config.is_file():
        adapters = _adapter_state(source)
        with tempfile.TemporaryDirectory() as scratch:
            staged = Path(scratch)
            save_file(adapters, str(staged / ADAPTER_WEIGHTS))
            shutil.copyfile(adapter_config, staged / ADAPTER_CONFIG)
            if not merged:
                try:
                    out.mkdir(parents=True, exist_ok=True)
                    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
                        shutil.copyfile(staged / name, out / name)
                    AutoTokenizer.from_pretrained(source / ACTOR_STATE / HF_FILES).save_pretrained(out)
                except OSError as error:
                    raise UserError(
                        f"cannot write the exported adapters to {out}: {error.strerror or error}"
                    ) from error
                return out
            model = _load_lora_actor(source, staged).to(dtype)
    else:
        model = _load_actor(source).to(dtype)
    hf_dir = source / ACTOR_STATE / HF_FILES
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        generation = GenerationConfig.from_pretrained(hf_dir) if (hf_dir / "generation_config.json").is_file() else None
    except UNREADABLE as error:
        raise CheckpointError(f"cannot export {source}: its tokenizer does not load ({_error_text(error)})") from error
    try:
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        if generation is not None:
            generation.save_pretrained(out)
    except OSError as error:
        raise UserError(f"cannot write the exported model to {out}: {error.strerror or error}") from error
    return out
