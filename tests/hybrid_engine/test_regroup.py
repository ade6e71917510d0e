"""The 3D-HybridEngine's regrouping: the groups against brute force, the byte counts against the
paper's formulas, and a real switch on 4 gloo ranks that holds exactly the generation shard."""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register
from hybridflow.hybrid_engine.layout import ActorLayouts
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.regroup import (
    Regrouping,
    gather_generation_shard,
    peak_generation_bytes,
    switch_bytes,
)

LAYOUTS = [(t, tg) for t in (1, 2, 4, 8) for tg in (1, 2, 4, 8) if t % tg == 0]


def interval(index: int, parts: int) -> tuple[Fraction, Fraction]:
    return Fraction(index, parts), Fraction(index + 1, parts)


@pytest.mark.parametrize("t, tg", LAYOUTS)
def test_every_training_shard_lies_inside_its_generation_shard(t, tg):
    regrouping = Regrouping(t=t, tg=tg)
    for rank in range(t):
        low, high = interval(rank, t)
        gen_low, gen_high = interval(regrouping.generation_shard(rank), tg)
        assert gen_low <= low and high <= gen_high  # nothing the rank trains on is held twice
    for group in regrouping.generation_groups():  # each generates with one holder of every shard
        assert sorted(regrouping.generation_shard(r) for r in group) == list(range(tg))
    for shard, group in enumerate(regrouping.gather_groups()):  # together they hold exactly that shard
        assert {regrouping.generation_shard(r) for r in group} == {shard}
        pieces = sorted(interval(r, t) for r in group)
        assert pieces[0][0] == interval(shard, tg)[0] and pieces[-1][1] == interval(shard, tg)[1]
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    all_ranks = sorted(r for g in regrouping.generation_groups() for r in g)
    assert all_ranks == list(range(t)) and len(regrouping.generation_groups()) == t // tg


def test_the_paper_grouping_is_strided():
    regrouping = Regrouping(t=4, tg=2)
    assert regrouping.gather_groups() == [[0, 1], [2, 3]]
    assert regrouping.generation_groups() == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="must divide"):
        Regrouping(t=4, tg=3)


def test_a_layout_shape_refuses_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="tg=3 must divide the training one t=4"):
        LayoutShape(dp=1, t=4, tg=3)
    assert LayoutShape.over(8, t=4, tg=2) == LayoutShape(dp=2, t=4, tg=2)
    assert LayoutShape.over(8, t=4, tg=2).world == 8
    with pytest.raises(ValueError, match="6 devices do not split into tensor-parallel groups of t=4"):
        LayoutShape.over(6, t=4)


@pytest.mark.parametrize("t, tg", LAYOUTS)
def test_bytes_by_brute_force(t, tg):
    """What a rank lacks of its generation shard, counted piece by piece, is the hybridflow formula."""
    model = 1000.0 * t * tg  # divisible
    regrouping = Regrouping(t=t, tg=tg)
    for rank in range(t):
        gather_group = regrouping.gather_groups()[regrouping.generation_shard(rank)]
        missing = sum(model / t for other in gather_group if other != rank)
        assert switch_bytes(model, dp=1, t=t, tg=tg, method="hybridflow") == pytest.approx(missing)
    # the paper's Table 2 forms: (t - tg) / (tg t) M; (t - 1) / t M; (N - 1) / N M
    assert switch_bytes(model, dp=1, t=t, tg=tg, method="hybridflow") == pytest.approx((t - tg) / (tg * t) * model)
    assert switch_bytes(model, dp=1, t=t, tg=tg, method="hybridflow_v") == pytest.approx((t - 1) / t * model)
    assert switch_bytes(model, dp=2, t=t, tg=tg, method="gather_all") == pytest.approx((2 * t - 1) / (2 * t) * model)
    assert peak_generation_bytes(model, tg=tg, method="hybridflow") == model / tg
    assert peak_generation_bytes(model, tg=tg, method="gather_all") == model


def test_fsdp_adds_the_unshard_within_dp():
    assert switch_bytes(800.0, dp=4, t=2, tg=2, method="hybridflow") == pytest.approx(800 / 2 * 3 / 4)
    with pytest.raises(ValueError, match="unknown switch method"):
        switch_bytes(1.0, dp=1, t=1, tg=1, method="nccl")


FULL = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)  # a column-parallel weight: rows are sharded


class Switcher(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def switch(self, tg: int) -> tuple[torch.Tensor, int, int]:
        """Hold training shard `rank` of FULL (t = world size), switch to tg: (generation shard, bytes
        received, generation shard index)."""
        t = self.world_size
        regrouping = Regrouping(t=t, tg=tg)
        training_shard = FULL.chunk(t, dim=0)[self.rank].clone()
        layouts = ActorLayouts.build(self.device, LayoutShape(dp=1, t=t, tg=tg))
        shard = regrouping.generation_shard(self.rank)
        generation = gather_generation_shard(training_shard, 0, layouts.gather_group)
        received = generation.numel() * generation.element_size() - training_shard.numel() * 4
        dist.barrier()
        return generation, received, shard


@pytest.fixture(scope="module")
def switchers(local_ray):
    pool = RayResourcePool([4])
    group = RayWorkerGroup(pool, RoleSpec(Switcher))
    yield group
    pool.release()


@pytest.mark.parametrize("tg", [1, 2, 4])
def test_a_switch_holds_exactly_the_generation_shard(switchers, tg):
    full_bytes = FULL.numel() * 4
    for generation, received, shard in switchers.switch(tg):
        torch.testing.assert_close(generation, FULL.chunk(tg, dim=0)[shard], rtol=0, atol=0)
        assert received == switch_bytes(full_bytes, dp=1, t=4, tg=tg, method="hybridflow")


@pytest.mark.parametrize("dp, t, tg", [(1, 4, 2), (2, 4, 2), (3, 2, 1), (2, 8, 4), (2, 2, 2)])
def test_the_rank_tables_are_the_regrouping_inside_each_training_group(dp, t, tg):

    shape = LayoutShape(dp=dp, t=t, tg=tg)
    regrouping = Regrouping(t=t, tg=tg)
    training = shape.training_ranks().tolist()
    expected_generation = [[tp_group[i] for i in g] for tp_group in training for g in regrouping.generation_groups()]
    expected_gather = [[tp_group[i] for i in g] for tp_group in training for g in regrouping.gather_groups()]
    assert shape.generation_ranks().tolist() == expected_generation  # row: a generation group, column: its shard
    assert shape.gather_ranks().tolist() == expected_gather
    assert sorted(r for row in expected_generation for r in row) == list(range(dp * t))
