"""Saving and loading one role's training state: sharded model + optimizer (torch.distributed.checkpoint),
the learning-rate schedule and each rank's random-number generators.

    <role>/dcp/.metadata          DCP's metadata: every tensor's global shape, and where its bytes lie
    <role>/dcp/__<rank>_0.distcp  each rank's shards
    <role>/scheduler.pt           the learning-rate schedule (rank 0)
    <role>/rng_rank<r>.pt         each rank's random-number generators

DCP stores every tensor with its global shape and offsets, so a checkpoint saved by N ranks
loads on M ranks (resharding on load). ``state_problems`` checks that layout without a process group.
The optimizer state is flattened (one entry per parameter, torch's ``flatten_optimizer_state_dict``; the settings that
every parameter shares, its one group's, saved once), and a pipelined model's stages save under the unsplit model's
names, so a checkpoint does not depend on the layout:
saved with pipeline stages, it loads without, and the reverse. A tied head's optimizer state is the embedding's
(equal by construction, engine/pipeline.py), saved once under the embedding's name as the unsplit model has it.
Checkpoints from before the flattening (one ``param_groups`` entry) still load, in the layout they were saved in.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from hybridflow.engine.lora import is_lora
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.pipeline import PipelinedModel

SHARDS = "dcp"
SCHEDULER = "scheduler.pt"
FIRST_RNG = "rng_rank0.pt"  # every load can fall back to it (a different number of ranks)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _state_options(trained: TrainedModel, flatten: bool = True) -> StateDictOptions:
    """A LoRA model's state is its adapters (and their optimizer state): the frozen base is the model
    directory's, unchanged, and is not saved again. Loading then sets the trainable weights only (not strict
    about the frozen ones); dcp.load has already failed if the checkpoint lacks any of those. ``flatten``: the
    optimizer state one entry per parameter (False: a checkpoint from before, read as it was written)."""
    lora = is_lora(trained.model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora, flatten_optimizer_state_dict=flatten)


_STAGE = re.compile(r"^stages\.\d+\.")  # a pipelined model's prefix of each stage's parameter names
_TIED_EMBEDDING = "model.embed_tokens.weight"
_GROUP = "param_groups."  # flattened: "param_groups.<fqn>.<setting>" for every parameter and setting
OPTIMIZER_SETTINGS = "optim_settings"  # the checkpoint's entry of the settings every parameter shares


def _checkpoint_name(key: str, model: nn.Module, part: str, loading: bool) -> str | None:
    """The name ``key`` of ``model``'s ``part`` ("model" or "optim", whose keys are "state.<fqn>.<name>") state has
    in a checkpoint: a pipelined model's without the stage prefix; a tied head's optimizer state is the embedding's
    (None when saving: saved once, by the first stage)."""
    if not isinstance(model, PipelinedModel):
        return key
    if part == "model":
        return _STAGE.sub("", key)
    kind, _, rest = key.partition(".")
    name = _STAGE.sub("", rest)
    head = model.tied_head_name
    if head is not None and name.startswith(head + "."):
        if not loading:
            return None
        name = _TIED_EMBEDDING + name[len(head) :]
    return f"{kind}.{name}"


def _renamed(state: dict, model: nn.Module, part: str, loading: bool) -> dict[str, str]:
    """{checkpoint name: this model's name} of ``state``'s keys (``_checkpoint_name``)."""
    names = {}
    for key in state:
        saved = _checkpoint_name(key, model, part, loading)
        if saved is not None:
            names[saved] = key
    return names


def _shared_settings(optim_state: dict) -> tuple[dict, dict]:
    """(the flattened optimizer state without its per-parameter settings, the settings once): the optimizers here
    have one parameter group, so every parameter's "param_groups.<fqn>.<setting>" is the same value. Saved once, the
    checkpoint stays small (a LoRA model's hundred adapters would otherwise each bring a dozen entries)."""
    tensors, settings = {}, {}
    for key, value in optim_state.items():
        if not key.startswith(_GROUP):
            tensors[key] = value
            continue
        setting = key.rsplit(".", 1)[1]
        if setting in settings and settings[setting] != value:
            raise ValueError(f"optimizer setting {setting!r} differs between parameter groups: a checkpoint keeps one")
        settings[setting] = value
    return tensors, settings


def _training_state(trained: TrainedModel, options: StateDictOptions) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts. A LoRA model's holds its trainable weights only: torch's
    ``ignore_frozen_params`` keeps a frozen weight that a model ties under a second name (the LM head of a model
    with tied embeddings, the size of the embedding), since that name is no parameter's."""
    model_state, optim_state = get_state_dict(trained.model, trained.optimizer, options=options)
    if options.ignore_frozen_params:
        trainable = {name for name, p in trained.model.named_parameters() if p.requires_grad}
        model_state = {name: value for name, value in model_state.items() if name in trainable}
    return model_state, optim_state


def save_training_state(directory: Path, trained: TrainedModel, rank: int) -> None:
    """Collective: every rank of the group calls it with the same directory."""
    directory.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = _training_state(trained, _state_options(trained))
    optim_state, settings = _shared_settings(optim_state)
    model = trained.model
    saved = {
        part: {name: state[key] for name, key in _renamed(state, model, part, loading=False).items()}
        for part, state in (("model", model_state), ("optim", optim_state))
    }
    dcp.save(saved | {OPTIMIZER_SETTINGS: settings}, checkpoint_id=str(directory / SHARDS))
    if rank == 0:
        torch.save(trained.scheduler.state_dict(), directory / SCHEDULER)
    torch.save(rng_state(), directory / f"rng_rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()


def load_training_state(directory: Path, trained: TrainedModel, rank: int) -> None:
    """Collective. Works on a different number of ranks than saved; RNG states then come from rank 0's file."""
    if not (directory / SHARDS).is_dir():
        raise FileNotFoundError(
            f"{directory} holds no sharded training state ('{SHARDS}/'); is it a hybridflow checkpoint?"
        )
    metadata = _read_metadata(directory / SHARDS)
    flattened = isinstance(metadata, str) or "optim.param_groups" not in metadata.state_dict_metadata
    options = _state_options(trained, flatten=flattened)
    model_state, optim_state = _training_state(trained, options)
    settings, group_keys = {}, []
    if flattened:
        group_keys = [key for key in optim_state if key.startswith(_GROUP)]
        optim_state, settings = _shared_settings(optim_state)
    model = trained.model
    wanted = {"model": model_state, "optim": optim_state}
    names = {part: _renamed(state, model, part, loading=True) for part, state in wanted.items()}
    state = {part: {name: wanted[part][key] for name, key in names[part].items()} for part in names}
    if flattened:
        state[OPTIMIZER_SETTINGS] = settings
    dcp.load(state, checkpoint_id=str(directory / SHARDS))
    loaded = {part: {key: state[part][name] for name, key in names[part].items()} for part in names}
    # every parameter's settings, from the one entry saved
    loaded["optim"] |= {key: state[OPTIMIZER_SETTINGS][key.rsplit(".", 1)[1]] for key in group_keys}
    set_state_dict(
        trained.model,
        trained.optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optim"],
        options=options,
    )
    if (directory / SCHEDULER).is_file():
        trained.scheduler.load_state_dict(torch.load(directory / SCHEDULER, weights_only=False))
    rng_file = directory / f"rng_rank{rank}.pt"
    set_rng_state(torch.load(rng_file if rng_file.is_file() else directory / FIRST_RNG, weights_only=False))


def _file_problem(path: Path, name: str, min_size: int = 0) -> str | None:
    """Why ``path`` cannot be what a load reads: missing, unreadable, or shorter than ``min_size`` bytes."""
    try:
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as error:
        return f"{name} cannot be read ({error.strerror or error})"
    if size < min_size:
        return f"{name} has {size} bytes, and its DCP metadata places {min_size} in it"
    return None


def _read_metadata(shards: Path) -> Metadata | str:
    """DCP's metadata of ``shards``, read without a process group; or why it cannot be read."""
    name = f"{SHARDS}/.metadata"
    try:
        metadata = dcp.FileSystemReader(str(shards)).read_metadata()
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as error:
        return f"{name} cannot be read ({error.strerror or error})"
    except Exception as error:  # a pickle of anything else, or cut short, fails in many ways
        return f"{name} is not DCP metadata ({type(error).__name__}: {error})"
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        return f"{name} is not DCP metadata (a {type(metadata).__name__})"
    return metadata


def state_problems(directory: Path) -> list[str]:
    """What keeps ``directory`` (one role's state, as ``save_training_state`` wrote it) from loading, found
    without a process group and without reading the shards: DCP's metadata missing or unreadable, or
    holding no model; a shard file it names missing, unreadable or shorter than the bytes it places
    there; rank 0's RNG state missing. Names are relative to ``directory``; empty when it looks whole.
    The bytes themselves are checked only by the checkpoint's manifest (trainer/services/checkpoint.py)."""
    metadata = _read_metadata(directory / SHARDS)
    if isinstance(metadata, str):
        return [metadata]
    found = []
    if not any(fqn.startswith("model.") for fqn in metadata.state_dict_metadata):
        found.append(f"{SHARDS}/.metadata holds no model weights")
    ends: dict[str, int] = {}  # shard file -> the end of the last bytes the metadata places in it
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        found.append(_file_problem(directory / SHARDS / name, f"{SHARDS}/{name}", end))
    found.append(_file_problem(directory / FIRST_RNG, FIRST_RNG))
    if (directory / SCHEDULER).exists():
        found.append(_file_problem(directory / SCHEDULER, SCHEDULER))
    return [problem for problem in found if problem]
