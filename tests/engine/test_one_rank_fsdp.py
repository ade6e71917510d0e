"""FSDP2 on one gloo rank with its copies skipped (engine/one_rank_fsdp.py's gather, host_collectives.py's
``OneRankReduceScatter``) trains to the same bits as FSDP2's own path, and no weight is cast to a tensor of its own on
the way to the gathered weights (one pass)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.engine.fsdp import gathered_through_backward
from hybridflow.engine.host_collectives import OneRankReduceScatter, use_host_collectives

CPU = torch.device("cpu")


class ReadsOf(TorchDispatchMode):
    """Counts the ``aten._to_copy`` calls whose input is one of ``watched`` (by storage)."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.watched = {tensor.untyped_storage().data_ptr() for tensor in watched}
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.watched:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def _train(skip_copies: bool, keep_gathered: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    units = [model[0], model[2], model]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    if skip_copies:
        assert use_host_collectives(units, dist.group.WORLD) is None  # one rank: no shared memory, the copies skipped
    initial = [p.full_tensor().clone() for p in model.parameters()]
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    casts = 0
    for step in range(3):
        with gathered_through_backward(model, keep_gathered):  # as the engine's updates run
            for micro in inputs.chunk(3 if step else 1):  # gradients accumulate over micro-batches
                with ReadsOf(shards) as reads:
                    model(micro).square().mean().backward()
                casts += reads.casts
        optimizer.step()  # the next forward gathers the new weights
        optimizer.zero_grad()
    return initial, [p.full_tensor().clone() for p in model.parameters()], casts


def _one_rank(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    torch.set_num_threads(1)
    try:
        results = {(skip, keep): _train(skip, keep) for skip in (False, True) for keep in (False, True)}
        torch.save(results, out)
    finally:
        dist.destroy_process_group()


def test_one_rank_reduce_hands_out_its_input_as_the_output():
    reduce = OneRankReduceScatter()  # FSDP2's order: the input, then an output of the same size: one buffer
    first = reduce.allocate((6,), dtype=torch.float32, device=CPU)
    assert reduce.allocate((6,), dtype=torch.float32, device=CPU) is first
    second = reduce.allocate((6,), dtype=torch.float32, device=CPU)  # the next reduce-scatter: a new buffer
    assert second is not first and reduce.allocate((6,), dtype=torch.float32, device=CPU) is second
    other = reduce.allocate((6,), dtype=torch.float32, device=CPU)
    assert reduce.allocate((6,), dtype=torch.bfloat16, device=CPU) is not other  # another dtype: not the input


def test_one_rank_skips_fsdp_copies_and_changes_no_bit(tmp_path):
    out = str(tmp_path / "one-rank.pt")
    mp.spawn(_one_rank, args=(str(tmp_path / "init-one"), out), nprocs=1)
    results = torch.load(out)
    for keep in (False, True):
        initial, plain, plain_casts = results[(False, keep)]
        _, skipped, skipped_casts = results[(True, keep)]
        for expected, got in zip(plain, skipped):
            assert torch.equal(expected, got), keep
        # the weights moved: three optimizer steps ran
        assert all(not torch.equal(trained, start) for trained, start in zip(skipped, initial))
        # FSDP2 casts each of the 4 shards once per gather: 3 steps of 1 + 3 micro-batches, gathered for each forward
        # and again for its backward unless kept; skipped, the gathered weights are written from the shards directly
        assert plain_casts == 4 * (3 if keep else 7 * 2) and skipped_casts == 0, (keep, plain_casts, skipped_casts)
