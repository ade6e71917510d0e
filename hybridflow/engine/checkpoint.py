"""Saving and loading one role's training state: sharded model + optimizer (torch.distributed.checkpoint),
the learning-rate schedule and each rank's random-number generators.

DCP stores every tensor with its global shape and offsets, so a checkpoint saved by N ranks
loads on M ranks (resharding on load).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hybridflow.engine.optim import TrainedModel

SHARDS = "dcp"
SCHEDULER = "scheduler.pt"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_training_state(directory: Path, trained: TrainedModel, rank: int) -> None:
    """Collective: every rank of the group calls it with the same directory."""
    directory.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = get_state_dict(trained.model, trained.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory / SHARDS))
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
    model_state, optim_state = get_state_dict(trained.model, trained.optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory / SHARDS))
    set_state_dict(trained.model, trained.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if (directory / SCHEDULER).is_file():
        trained.scheduler.load_state_dict(torch.load(directory / SCHEDULER, weights_only=False))
    rng_file = directory / f"rng_rank{rank}.pt"
    set_rng_state(torch.load(rng_file if rng_file.is_file() else directory / "rng_rank0.pt", weights_only=False))
