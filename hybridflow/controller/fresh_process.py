"""The process-wide state a worker process starts with, and putting it back after a run so that a kept
process (kept_processes.py) serves the next run as a new process would."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import random
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Modules whose use changes a process for good: vLLM's engine reseeds the random generators, replaces
# torch.set_num_threads and sets up its own distributed state (rollout/vllm/rollout.py undoes what it can).
PROCESS_CHANGING_MODULES = ("vllm",)
THREAD_EXIT_WAIT_S = 2.0  # a run's threads that are ending as it ends get this long
# Threads a library starts once per process and keeps, holding nothing of a run: tqdm's monitor of its bars.
PROCESS_THREADS = ("tqdm_monitor",)


@dataclass(frozen=True)
class FreshProcessState:
    environ: dict[str, str]
    torch_seed: int
    default_dtype: torch.dtype
    threads: frozenset[int]  # the idents of the threads alive at the start

    @classmethod
    def now(cls) -> FreshProcessState:
        return cls(
            environ=dict(os.environ),
            torch_seed=torch.initial_seed(),
            default_dtype=torch.get_default_dtype(),
            threads=frozenset(t.ident for t in threading.enumerate()),
        )

    def new_threads(self) -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t.ident not in self.threads and t.is_alive() and t.name not in PROCESS_THREADS
        ]

    def restore(self) -> str | None:
        """Leave the process group and restore the environment variables, torch's default seed and dtype and
        gradient mode; reseed Python's and NumPy's generators from the OS as at a start. Call after the run's
        objects are dropped. Returns why the process cannot be made new (None: it was): a module that changes a
        process for good was imported, or a thread the run started is still running."""
        changed = [name for name in PROCESS_CHANGING_MODULES if name in sys.modules]
        if changed:
            return f"{changed[0]} was imported"
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_device_meshes()
        gc.collect()
        deadline = time.monotonic() + THREAD_EXIT_WAIT_S
        while self.new_threads() and time.monotonic() < deadline:
            time.sleep(0.02)
        if running := self.new_threads():
            return f"threads still running: {', '.join(sorted(t.name for t in running))}"
        os.environ.clear()
        os.environ.update(self.environ)
        torch.manual_seed(self.torch_seed)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(True)
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        _return_free_memory()
        return None


def _forget_device_meshes() -> None:
    """Drop DTensor's caches of sharding decisions and redistribution plans: an entry keeps its device mesh, and with
    it the names of the process groups of a run that has ended; a mesh of the next run equal to it (the same ranks,
    layout and names) would find that entry, and its operations would ask for groups that no longer exist."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()  # this thread's: the one that runs the workers' methods
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch's own cache of the same


def _return_free_memory() -> None:
    """Hand the heap's free pages back to the kernel: workers keep freed memory while they train (the allocator
    settings of ray_runtime.py), which a waiting process should not hold."""
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
