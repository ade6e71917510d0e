"""Dispatch and collect functions on their own, without Ray: which rank gets what, what comes back."""

import pytest
import torch

from hybridflow.controller import (
    CollectSpec,
    Dispatch,
    DispatchPlan,
    Execute,
    GroupLayout,
    MeshCoord,
    Worker,
    get_dispatch_mode,
    register,
    register_dispatch_mode,
)
from hybridflow.controller.decorator import registered_methods
from hybridflow.protocol import DataProto


def layout(world_size: int, meshes: dict | None = None) -> GroupLayout:
    return GroupLayout(world_size, lambda name: meshes[name])


def rows(data: DataProto) -> list:
    return data.batch["i"].tolist()


def numbered(n: int) -> DataProto:
    return DataProto.from_dict({"i": torch.arange(n)})


def test_one_to_all_broadcasts_and_lists_outputs():
    plan = Dispatch.ONE_TO_ALL.dispatch(layout(3), (5,), {"k": "v"})
    assert plan.args == [(5,)] * 3 and plan.kwargs == [{"k": "v"}] * 3
    assert Dispatch.ONE_TO_ALL.collect(["a", "b", "c"], plan.collect) == ["a", "b", "c"]


def test_all_to_all_gives_each_rank_its_entry_and_broadcasts_the_rest():
    plan = Dispatch.ALL_TO_ALL.dispatch(layout(2), ([10, 11], "same"), {"k": [0, 1]})
    assert plan.args == [(10, "same"), (11, "same")] and plan.kwargs == [{"k": 0}, {"k": 1}]


def test_dp_compute_requires_per_rank_lists():
    plan = Dispatch.DP_COMPUTE.dispatch(layout(2), (["a", "b"],), {})
    assert plan.args == [("a",), ("b",)]
    with pytest.raises(ValueError, match="list of 2 entries"):
        Dispatch.DP_COMPUTE.dispatch(layout(2), (["a", "b", "c"],), {})


def test_dp_compute_proto_pads_splits_and_unpads():
    plan = Dispatch.DP_COMPUTE_PROTO.dispatch(layout(4), (numbered(6),), {"flag": True})
    # 6 rows over 4 ranks: padded to 8 with copies of rows 0, 1; 2 rows per rank.
    assert [rows(a[0]) for a in plan.args] == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert plan.kwargs == [{"flag": True}] * 4 and plan.collect.pad_size == 2
    outputs = [DataProto.from_dict({"i": a[0].batch["i"] * 10}) for a in plan.args]
    assert rows(Dispatch.DP_COMPUTE_PROTO.collect(outputs, plan.collect)) == [0, 10, 20, 30, 40, 50]


def test_dp_compute_proto_rejects_unequal_lengths():
    with pytest.raises(ValueError, match="equal lengths"):
        Dispatch.DP_COMPUTE_PROTO.dispatch(layout(2), (numbered(2), numbered(4)), {})


def test_dp_compute_proto_with_func_broadcasts_the_function():
    plan = Dispatch.DP_COMPUTE_PROTO_WITH_FUNC.dispatch(layout(2), (abs, numbered(4)), {})
    assert [a[0] for a in plan.args] == [abs, abs] and [rows(a[1]) for a in plan.args] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="function as its first argument"):
        Dispatch.DP_COMPUTE_PROTO_WITH_FUNC.dispatch(layout(2), (numbered(4),), {})


def test_dp_compute_metric_splits_and_lists():
    plan = Dispatch.DP_COMPUTE_METRIC.dispatch(layout(2), (numbered(4),), {})
    assert [rows(a[0]) for a in plan.args] == [[0, 1], [2, 3]]
    assert Dispatch.DP_COMPUTE_METRIC.collect([{"loss": 1.0}, {"loss": 2.0}], plan.collect) == [
        {"loss": 1.0},
        {"loss": 2.0},
    ]


def test_mesh_dispatch_uses_only_the_dp_coordinate():
    # dp=2 x tp=2, rank = dp * 2 + tp; the tp=0 rank of each dp group collects.
    coords = [MeshCoord(dp_rank=r // 2, dp_size=2, is_collector=r % 2 == 0) for r in range(4)]
    mode = Dispatch.MESH_COMPUTE_PROTO("test_mesh")
    plan = mode.dispatch(layout(4, {"test_mesh": coords}), (numbered(3),), {})
    # 3 rows over dp=2: padded to 4 (row 0 repeated); dp 0 gets [0, 1], dp 1 gets [2, 0].
    assert [rows(a[0]) for a in plan.args] == [[0, 1], [0, 1], [2, 0], [2, 0]]
    assert plan.collect == CollectSpec(ranks=(0, 2), pad_size=1)
    assert mode is Dispatch.MESH_COMPUTE_PROTO("test_mesh")


def test_mesh_dispatch_rejects_missing_collectors():
    coords = [MeshCoord(dp_rank=0, dp_size=2, is_collector=True)] * 2
    with pytest.raises(ValueError, match="one collecting rank per data-parallel rank"):
        Dispatch.MESH_COMPUTE_PROTO("bad_mesh").dispatch(layout(2, {"bad_mesh": coords}), (numbered(2),), {})


def _reverse_dispatch(layout, args, kwargs):
    return DispatchPlan([args] * layout.world_size, [kwargs] * layout.world_size)


def _reverse_collect(outputs, spec):
    return list(reversed(outputs))


def test_user_dispatch_mode_is_registered_by_name():
    mode = register_dispatch_mode("TEST_REVERSED", _reverse_dispatch, _reverse_collect)
    assert get_dispatch_mode("TEST_REVERSED") is mode
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("TEST_REVERSED", _reverse_dispatch, _reverse_collect)
    with pytest.raises(ValueError, match="unknown dispatch mode 'NOPE'"):
        get_dispatch_mode("NOPE")

    class Custom(Worker):
        @register(dispatch_mode="TEST_REVERSED")
        def f(self):
            return 1

    assert registered_methods(Custom)["f"].dispatch_mode is mode


def test_register_records_spec_and_keeps_the_method_callable():
    class Base(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
        def hello(self, x):
            return x + 1

        def plain(self):
            return 0

    class Child(Base):
        def hello(self, x):  # overridden without @register: no longer remote
            return x

    spec = registered_methods(Base)["hello"]
    assert spec.dispatch_mode is Dispatch.ONE_TO_ALL and spec.execute_mode is Execute.RANK_ZERO and not spec.blocking
    assert set(registered_methods(Base)) == {"hello"} and registered_methods(Child) == {}
    worker = Base.__new__(Base)
    assert worker.hello(1) == 2 and Base.hello.__doc__ is None
    with pytest.raises(TypeError, match="execute_mode"):
        register(execute_mode="all")
