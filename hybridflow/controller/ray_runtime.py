"""Starting or joining the Ray cluster the driver runs on."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import ray

from hybridflow.library_output import quiet_env, verbose


def _driver_pythonpath() -> str:
    """The driver's import path, so that worker processes import the same modules (a script's own workers too)."""
    entries = [p for p in sys.path if p and os.path.isdir(p)]
    if os.getcwd() not in entries:
        entries.insert(0, os.getcwd())
    existing = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(entries + ([existing] if existing else []))


# glibc hands freed blocks above a few MB back to the kernel, and the next allocation of that size
# page-faults its memory in again. Training allocates such blocks every micro-batch (activations,
# bf16 weight casts, logits, gradients), so workers keep freed memory for reuse instead
# (bench/train_passes.py, 2 CPU cores, one update of a 135 M model on 32 samples: 2.36 s -> 1.57 s).
# A value already in the driver's environment wins.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def kernel_cache_env(capacity: int) -> dict[str, str]:
    """Bound the two caches of compiled CPU kernels that torch keeps per input shape (oneDNN's primitive
    cache and ideep's LRU cache, 1024 entries each by default). Packed batches change shape every step,
    so with the defaults every step adds kernels until both caches are full: a worker's resident memory
    kept growing for some 50 steps (bench/kernel_caches.py, bench/memory.py, docs/results.md).
    A step reuses its own shapes across layers, so a small cache loses no speed, while no cache costs
    time (bench/kernel_caches.py). Capacity must be >= 1: ideep crashes the process at 0."""
    return {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(capacity), "LRU_CACHE_CAPACITY": str(capacity)}


def _driver_first(settings: dict[str, str]) -> dict[str, str]:
    """``settings``, except where the driver's environment already sets a key: then the driver's value."""
    return {key: os.environ.get(key, value) for key, value in settings.items()}


def tuning_env(kernel_cache_capacity: int) -> dict[str, str]:
    """The allocator and kernel-cache settings of a run's worker processes (a value already in the driver's
    environment wins). Each worker group's actors ask for them (``RayResourcePool(worker_env=...)``, merged with
    the cluster's environment), so a run gets them on any cluster: one it starts, or one started elsewhere
    (``ray.init()`` in a notebook, ``ray start``, ``trainer.ray_address``)."""
    return _driver_first({**ALLOCATOR_ENV, **kernel_cache_env(kernel_cache_capacity)})


def worker_env_vars(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of every worker process: the driver's import path, unbuffered logs, the allocator
    settings, libraries' progress bars and start-up chatter off (library_output.py; not with --debug) and
    ``extra``. A value already in the driver's environment wins."""
    return {
        "PYTHONPATH": _driver_pythonpath(),
        "RAY_DEDUP_LOGS": "0",
        **quiet_env(),
        **_driver_first({**ALLOCATOR_ENV, **(extra or {})}),
    }


def driver_runtime_env(extra_env: dict[str, str] | None = None) -> dict:
    return {"env_vars": worker_env_vars(extra_env)}


def start_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    worker_env: dict[str, str] | None = None,
) -> bool:
    """Start a local Ray cluster (``address`` None) or join one. Returns whether this call started Ray.

    ``num_cpus``: the local cluster's logical CPUs (None: Ray's default, the machine's cores). Logical
    CPUs only decide what Ray may place; threads per worker are what bound real CPU use, so a
    small machine may host more workers than it has cores (``trainer.ray_num_cpus``).
    ``worker_env``: more environment variables for every worker process.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict = {"runtime_env": driver_runtime_env(worker_env), "include_dashboard": False, "log_to_driver": True}
    kwargs["logging_level"] = logging.INFO if verbose() else logging.WARNING  # "Started a local Ray instance."
    if address:
        ray.init(address=address, **kwargs)
    else:
        # "local": a new cluster of our own. Without it Ray joins the newest cluster that `ray start` (or a
        # test's ray.cluster_utils.Cluster) left its address for, whoever started it, and then refuses num_cpus
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
    return True


@contextlib.contextmanager
def ray_session(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    worker_env: dict[str, str] | None = None,
) -> Iterator[None]:
    """Ray for the duration of a block; a cluster this block started is shut down when it ends, error or not."""
    started = start_ray(address, num_cpus, num_gpus, worker_env)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
