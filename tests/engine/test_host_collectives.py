"""engine/host_collectives.py called as FSDP2 calls it, on 3 real gloo ranks (one spawn, for time): gloo's results
(bitwise on a group of 2, to rounding on 3), through growing buffers and with one rank running ahead; no file left
in /dev/shm; gloo kept when a rank is on another host or /dev/shm lacks room. One rank:
tests/engine/test_one_rank_fsdp.py. The FSDP2 update through shared memory: tests/engine/test_fsdp.py."""

import errno
import gc
import glob
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from hybridflow.engine import host_collectives
from hybridflow.engine.host_collectives import (
    HostCollectives,
    SharedMemoryAllGather,
    SharedMemoryReduceScatter,
    host_collectives_for,
    ranks_share_host,
    use_host_collectives,
)

WORLD = 3
CPU = torch.device("cpu")
# growing sizes (the buffers are remapped), both dtypes, both ops, twice over (the two buffers alternate)
CALLS = [
    (6, torch.float32, dist.ReduceOp.SUM),
    (3000, torch.float32, dist.ReduceOp.AVG),
    (1 << 19, torch.bfloat16, dist.ReduceOp.AVG),
    (1 << 19, torch.float32, dist.ReduceOp.SUM),
    (600_000, torch.float32, dist.ReduceOp.AVG),
    (12, torch.bfloat16, dist.ReduceOp.SUM),
] * 2


def _compare(group: dist.ProcessGroup, rank: int) -> list:
    """Each collective through shared memory and through gloo, in FSDP2's order of calls (allocate the input, fill
    it, allocate the output, call); the group's rank 1 sleeps now and then, so the others run a collective ahead."""
    world = dist.get_world_size(group)
    host = HostCollectives(group)
    reduce, gather = SharedMemoryReduceScatter(host), SharedMemoryAllGather(host)
    results = []
    for call, (numel, dtype, op) in enumerate(CALLS):
        generator = torch.Generator().manual_seed(1000 * call + rank)
        full = torch.randn(world * numel, generator=generator).to(dtype)
        expected = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter_single(expected, full.clone(), op=op, group=group)
        if host.rank == 1 and call % 3 == 0:
            time.sleep(0.05)
        shared_input = reduce.allocate((world * numel,), dtype=dtype, device=CPU)
        shared_input.copy_(full)
        output = reduce.allocate((numel,), dtype=dtype, device=CPU)
        reduce(output_tensor=output, input_tensor=shared_input, group=group, op=op)
        results.append(("reduce_scatter", call, expected, output.clone()))

        shard = torch.randn(numel // 2 + 1, generator=generator).to(dtype)
        gathered_expected = torch.empty(world * shard.numel(), dtype=dtype)
        dist.all_gather_single(gathered_expected, shard, group=group)
        gathered = gather.allocate((world * shard.numel(),), dtype=dtype, device=CPU)
        mine = gathered.narrow(0, host.rank * shard.numel(), shard.numel())
        mine.copy_(shard)
        gather(output_tensor=gathered, input_tensor=mine, group=group)
        results.append(("all_gather", call, gathered_expected, gathered.clone()))
        if host.rank == 0 and call % 4 == 1:
            time.sleep(0.05)
    return results


def _no_space(path: str, nbytes: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _ranks(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        everyone = _compare(dist.group.WORLD, rank)
        pair = dist.new_group([1, 2])  # a group whose ranks are not the world's: 2 addends, bitwise gloo
        paired = _compare(pair, rank) if rank in (1, 2) else []
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:  # /dev/shm without room for the buffers: gloo, said why
            warnings.simplefilter("always")
            no_room = not ranks_share_host(dist.group.WORLD, 1 << 60)
        room_warned = any("lacks" in str(warning.message) for warning in caught) if rank == 0 else True
        # a rank that cannot create its buffer (a full /dev/shm): every rank raises, naming it and the way out
        failing = HostCollectives(dist.group.WORLD)
        if rank == 1:
            failing.gradients._create = _no_space
        try:
            failing.gradients.ensure(1 << 20)
            refused = ""
        except RuntimeError as error:
            refused = str(error)
        if rank == 2:  # this rank reports another machine
            host_collectives._host_identity = lambda: "elsewhere/0"
        # a model's collectives dropped on every rank but rank 0, which has not collected them yet: every rank answers
        # none alike (acting alone, rank 0 would wait in shared memory while the others gather through gloo)
        kept = HostCollectives(dist.group.WORLD)
        host_collectives._HOSTS[dist.group.WORLD.group_name] = kept
        if rank != 0:
            del kept
            gc.collect()
        agreed_none = host_collectives_for(dist.group.WORLD) is None
        model = fully_shard(torch.nn.Linear(4, 4))
        kept_gloo = use_host_collectives([model], dist.group.WORLD) is None and agreed_none
        torch.save((everyone, paired, kept_gloo and no_room and room_warned, refused), f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_shared_memory_collectives_give_gloo_results(tmp_path):
    before = set(glob.glob("/dev/shm/hybridflow-fsdp-*"))
    out = str(tmp_path / "ranks")
    mp.spawn(_ranks, args=(str(tmp_path / "init"), out), nprocs=WORLD)
    assert set(glob.glob("/dev/shm/hybridflow-fsdp-*")) <= before  # every mapping was unlinked once mapped
    for rank in range(WORLD):
        everyone, paired, kept_gloo, refused = torch.load(f"{out}-{rank}.pt")
        assert kept_gloo  # one rank elsewhere, or no room in /dev/shm: every rank keeps gloo
        assert "could not create" in refused and "fsdp.host_collectives=false" in refused
        assert ("No space left" if rank == 1 else "another rank could not") in refused
        assert len(everyone) == 2 * len(CALLS) and len(paired) == (2 * len(CALLS) if rank else 0)
        for kind, call, expected, got in paired:  # two addends: a + b == b + a, bit for bit
            assert got.dtype == expected.dtype and torch.equal(got, expected), (kind, call)
        for kind, call, expected, got in everyone:
            assert got.dtype == expected.dtype
            if kind == "all_gather":  # no arithmetic: exact
                assert torch.equal(got, expected), (kind, call)
            else:  # three addends: the order of the additions may differ from gloo's ring
                # bf16: one unit in the last place of values up to 4 (2 ** -6); fp32: a few of its own
                tolerance = 2**-5 if got.dtype == torch.bfloat16 else 1e-6
                torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
