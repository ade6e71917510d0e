"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU ranks on one host.

On CPU, FSDP2 gathers weights and reduce-scatters gradients with gloo, which moves every byte through a TCP
socket on the loopback device: the demo's update (2 ranks on one host) spent a third of its time there
(docs/results.md). Ranks on one host can instead read each other's memory. Each rank maps a file in
/dev/shm (unlinked once every rank has mapped it, so nothing is left behind when a process dies), and FSDP2
writes its collective inputs straight into it (``allocate`` hands out views of the mapping):

- reduce-scatter: each rank writes its full gradient buffer into its own file; after a barrier, rank r sums
  chunk r of every rank's buffer, in rank order. With two ranks that is bitwise gloo's sum (a + b == b + a in
  IEEE arithmetic); with more, the order of the additions, and so the last bit, may differ from gloo's ring.
- all-gather: one file for the group; each rank writes its shard into its slot; after a barrier, the whole
  buffer is every rank's gathered output (FSDP2 copies it out into the layer's parameters).

The switch to generation gathers the weights through the same buffers (``HostCollectives.all_gather``, used by
hybrid_engine/reshard.py), found by process group (``host_collectives_for``).

A barrier (one small gloo all-reduce) orders each collective. Two buffers of each kind alternate, so a rank that
runs ahead writes the next collective's input while a slower rank still reads the last one: a rank can only be
one collective ahead, since it must pass that collective's barrier first. A gathered output may stay unread while
the rank runs one more collective (FSDP2 prefetches the next unit's gather before it copies that unit out, then
reduce-scatters): the other ranks cannot reuse its buffer before this rank starts the gather after that one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from hybridflow.engine.one_rank_fsdp import gather_in_one_pass

SHARED_MEMORY_DIR = "/dev/shm"
# profiler ranges around each collective (bench/update_profile.py and the tests find them by name)
REDUCE_SCATTER_EVENT = "host_collectives::reduce_scatter"
ALL_GATHER_EVENT = "host_collectives::all_gather"
_ALIGN = 1 << 20  # buffers grow in whole MiB


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _MappedBuffers:
    """Two alternating byte buffers per owner, mapped by every rank of the group. ``owners``: the ranks that own a
    file (all ranks for the reduce-scatter's inputs, rank 0 alone for the all-gather's shared output)."""

    def __init__(self, group: dist.ProcessGroup, prefix: str, name: str, owners: Sequence[int]) -> None:
        self.group, self.prefix, self.name, self.owners = group, prefix, name, list(owners)
        self.rank = dist.get_rank(group)
        self.nbytes = 0
        self.generation = 0
        self.views: list[list[torch.Tensor]] = []  # [slot][owner index] -> uint8 tensor of nbytes
        self.slot = 0  # the buffer the next collective uses; each collective flips it

    def current(self) -> list[torch.Tensor]:
        return self.views[self.slot]

    def _path(self, owner: int, slot: int) -> str:
        return os.path.join(SHARED_MEMORY_DIR, f"{self.prefix}-{self.name}-{owner}-{self.generation}-{slot}")

    def _map(self, owner: int, slot: int, nbytes: int) -> torch.Tensor:
        return torch.from_file(self._path(owner, slot), shared=True, size=nbytes, dtype=torch.uint8)

    def _create(self, path: str, nbytes: int) -> None:
        """The file with its pages reserved: a full /dev/shm fails here (ENOSPC), not as a SIGBUS when a page of a
        sparse mapping is first written."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)

    def ensure(self, nbytes: int) -> None:
        """Grow to at least ``nbytes`` (collective: every rank asks for the same sizes in the same order)."""
        if nbytes <= self.nbytes:
            return
        nbytes = -(-nbytes // _ALIGN) * _ALIGN
        self.generation += 1
        mine = [self._path(self.rank, slot) for slot in range(2)] if self.rank in self.owners else []
        error: OSError | None = None
        try:
            for path in mine:
                self._create(path, nbytes)
        except OSError as failure:
            error = failure
        # every rank learns whether all files exist (and waits until they do) before any maps them
        failed = torch.tensor([int(error is not None)])
        dist.all_reduce(failed, group=self.group)
        if int(failed):
            for path in mine:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            reason = f"{error}" if error is not None else "another rank could not"
            raise RuntimeError(
                f"could not create {nbytes} bytes of shared memory in {SHARED_MEMORY_DIR} for FSDP's collectives "
                f"({reason}); free space there or set fsdp.host_collectives=false"
            ) from error
        self.views = [[self._map(owner, slot, nbytes) for owner in self.owners] for slot in range(2)]
        dist.barrier(group=self.group)  # every rank holds every mapping: the names can go
        for path in mine:
            os.unlink(path)
        self.nbytes = nbytes


class HostCollectives:
    """Shared-memory all-gather and reduce-scatter for one data-parallel group whose ranks share a host."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        prefix = [f"hybridflow-fsdp-{uuid.uuid4().hex[:12]}" if self.rank == 0 else None]
        dist.broadcast_object_list(prefix, group_src=0, group=group)
        self.gradients = _MappedBuffers(group, prefix[0], "rs", range(self.world))
        self.weights = _MappedBuffers(group, prefix[0], "ag", [0])

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` (the same size on each), one after the other in rank order, flat: a view of the
        shared buffer, valid until this rank's next collective on the group (read or copy it before)."""
        numel = local.numel()
        shared = _shared_view(self.weights, 0, (numel * self.world,), local.dtype)
        self.weights.slot ^= 1
        with torch.profiler.record_function(ALL_GATHER_EVENT):
            shared[self.rank * numel : (self.rank + 1) * numel].copy_(local.reshape(-1))
            self.barrier()  # every rank's part is in the buffer
        return shared


def _shared_view(buffers: _MappedBuffers, owner: int, size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``size`` at the start of ``owner``'s buffer for the next collective (grown to hold it)."""
    nbytes = torch.Size(size).numel() * dtype.itemsize
    buffers.ensure(nbytes)
    return buffers.current()[owner][:nbytes].view(dtype).view(*size)


def _is_view_of(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel() and tensor.is_contiguous()


class InPlaceReduceScatter(ReduceScatter):
    """A reduce-scatter whose ``allocate`` may hand out the input buffer (``pending`` until the call): the call
    reduces it in place where ``reduce_in_place`` can, else through the process group (gloo)."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None  # the input handed out, not yet reduced

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        pending, self.pending = self.pending, None
        if pending is not None and self.reduce_in_place(output_tensor, input_tensor, group, op):
            return None
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    def reduce_in_place(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp
    ) -> bool:
        """Reduce the handed-out ``input_tensor`` into ``output_tensor`` without the process group; False where this
        call is not one it can take."""
        return False


class SharedMemoryReduceScatter(InPlaceReduceScatter):
    """FSDP2's reduce-scatter (``set_custom_reduce_scatter``): sum and, for ``AVG``, divide by the world size."""

    def __init__(self, host: HostCollectives) -> None:
        super().__init__()
        self.host = host

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.pending is not None or device.type != "cpu":  # the output (FSDP2 asks for the input first)
            return torch.empty(*size, dtype=dtype, device=device)
        self.pending = _shared_view(self.host.gradients, self.host.rank, size, dtype)
        return self.pending

    def reduce_in_place(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp
    ) -> bool:
        host = self.host
        if group is not host.group or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return False
        buffers = host.gradients.current()
        mine = buffers[host.rank]
        if not _is_view_of(input_tensor, mine):
            raise RuntimeError("FSDP2 reduce-scatter input is not the shared buffer handed out by allocate")
        host.gradients.slot ^= 1
        offset = input_tensor.data_ptr() - mine.data_ptr()
        nbytes = input_tensor.numel() * input_tensor.element_size()
        chunk = output_tensor.numel()
        parts = [
            buffer[offset : offset + nbytes].view(input_tensor.dtype)[host.rank * chunk : (host.rank + 1) * chunk]
            for buffer in buffers
        ]
        out = output_tensor.view(-1)
        with torch.profiler.record_function(REDUCE_SCATTER_EVENT):
            host.barrier()  # every rank's gradients are in its buffer
            torch.add(parts[0], parts[1], out=out)  # in rank order, one pass for the first two
            for part in parts[2:]:
                out.add_(part)
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(host.world)
        return True


class InPlaceAllGather(AllGather):
    """An all-gather that skips the process group (gloo) where ``gather_in_place`` has the output ready."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self.gather_in_place(output_tensor, input_tensor, group):
            return None
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    def gather_in_place(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> bool:
        """Make ``output_tensor`` the gathered shards without the process group; False where this call is not one
        it can take."""
        raise NotImplementedError


class SharedMemoryAllGather(InPlaceAllGather):
    """FSDP2's all-gather (``set_custom_all_gather``): the output is one buffer that every rank maps."""

    def __init__(self, host: HostCollectives) -> None:
        self.host = host

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(*size, dtype=dtype, device=device)
        return _shared_view(self.host.weights, 0, size, dtype)

    def gather_in_place(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> bool:
        host = self.host
        shared = host.weights.current()[0] if host.weights.views else None
        if group is not host.group or shared is None or not _is_view_of(output_tensor, shared):
            return False
        host.weights.slot ^= 1
        with torch.profiler.record_function(ALL_GATHER_EVENT):
            host.barrier()  # every rank's shard is in its slot of the shared output
        return True


class OneRankReduceScatter(InPlaceReduceScatter):
    """FSDP2's reduce-scatter on a group of one rank. FSDP2 then skips the collective but still copies the input
    buffer (the gradients, cast to the reduce dtype) into a second buffer of the same size; handing out the input
    as the output makes that copy a no-op (``copy_`` of a tensor onto itself), the same values without a pass over
    every gradient. (``pending``: the input handed out; FSDP2 asks for the output next.)"""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        pending, self.pending = self.pending, None
        if pending is not None and pending.shape == torch.Size(size) and pending.dtype == dtype:
            return pending
        self.pending = torch.empty(*size, dtype=dtype, device=device)
        return self.pending


def shared_memory_needed(units: Sequence[FSDPModule], world: int) -> int:
    """Bytes of /dev/shm the collectives map at most, all ranks together: per rank two fp32 reduce-scatter inputs
    of the largest unit (its own parameters, unsharded), and two gathered outputs of it for the group."""
    seen: set[int] = set()
    largest = 0
    for unit in sorted(units, key=lambda module: sum(1 for _ in module.modules())):  # inner units first
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        largest = max(largest, sum(p.numel() for p in own))
    return 2 * (world + 1) * (largest * 4 + _ALIGN)


def ranks_share_host(group: dist.ProcessGroup, needed_bytes: int) -> bool:
    """Whether every rank of ``group`` runs on this host, which has ``needed_bytes`` free in /dev/shm."""
    try:
        stats = os.statvfs(SHARED_MEMORY_DIR)
        usable = os.access(SHARED_MEMORY_DIR, os.W_OK) and stats.f_bavail * stats.f_frsize >= needed_bytes
    except OSError:
        usable = False
    identities: list[tuple[str, bool] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(identities, (_host_identity(), usable), group=group)
    if len({identity for identity, _ in identities}) > 1:
        return False
    if not all(ok for _, ok in identities):
        if dist.get_rank(group) == 0:
            warnings.warn(
                f"FSDP's collectives stay on gloo: {SHARED_MEMORY_DIR} lacks {needed_bytes >> 20} MiB free (or is "
                "not writable) for shared-memory collectives; give it more room (docker run --shm-size) to use them",
                stacklevel=2,
            )
        return False
    return True


# by process-group name (checked against the group itself: names recur). Weak: a group's buffers live as long as
# the FSDP2 units that use them, so a kept worker process (controller/kept_processes.py) does not hold a finished
# run's shared memory mapped
_HOSTS: weakref.WeakValueDictionary[str, HostCollectives] = weakref.WeakValueDictionary()


def host_collectives_for(group: dist.ProcessGroup) -> HostCollectives | None:
    """The shared-memory collectives of ``group`` (its FSDP2 units use them), None where it has none. A collective:
    every rank of the group calls it, and all get an answer alike. An entry lives as long as a model uses it, and each
    rank collects a dropped model at its own time, so one rank may still find the entry that another no longer has:
    the ranks then agree on none (an all-reduce of one integer), where acting on their own answers would send some
    through shared memory and the rest through gloo, and hang."""
    host = _HOSTS.get(group.group_name)
    mine = host if host is not None and host.group is group else None
    everyone = torch.tensor([int(mine is not None)])
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
    return mine if int(everyone) else None


def use_host_collectives(units: Sequence[FSDPModule], group: dist.ProcessGroup) -> HostCollectives | None:
    """Route the FSDP2 units' collectives on ``group`` through shared memory when its ranks share a CPU host with
    room in /dev/shm (collective: every rank of the group calls it). Returns None, leaving gloo, where they do not;
    on a group of one rank, where nothing moves, the units skip FSDP2's copies instead (``OneRankReduceScatter``,
    engine/one_rank_fsdp.py's gather).
    Models sharded over the same group (the actor, the reference) share one set of buffers."""
    world = dist.get_world_size(group)
    if world == 1:  # nothing to move between ranks: only FSDP2's copies to skip
        one_rank_reduce = OneRankReduceScatter()
        for unit in units:
            unit.set_custom_reduce_scatter(one_rank_reduce)
            gather_in_one_pass(unit)
        return None
    host = host_collectives_for(group)
    if host is None:
        if not ranks_share_host(group, shared_memory_needed(units, world)):
            return None
        host = HostCollectives(group)
        _HOSTS[group.group_name] = host
    gather, reduce = SharedMemoryAllGather(host), SharedMemoryReduceScatter(host)
    for unit in units:
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(reduce)
    return host
