"""The driver's handle of one role: every ``@register``ed method of the role's class, callable on all ranks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any

from hybridflow.controller.decorator import (
    DispatchPlan,
    Execute,
    GroupLayout,
    MeshCoord,
    MethodSpec,
    registered_methods,
)
from hybridflow.protocol import DataProtoFuture


class GroupFuture:
    """The pending result of a non-blocking call whose outputs are not DataProtos."""

    def __init__(self, futures: list, collect_fn: Callable[[list], Any], resolve: Callable[[list], list]):
        self.futures = futures
        self._collect_fn = collect_fn
        self._resolve = resolve

    def get(self) -> Any:
        return self._collect_fn(self._resolve(self.futures))


def _first(outputs: list) -> Any:
    return outputs[0]


class GroupMethod:
    """A ``@register``ed method seen from the driver: ``group.method(...)`` calls it on the ranks as
    its registration says (blocking or not); ``group.method.future(...)`` always returns at once, with
    a DataProtoFuture (DataProto-collecting methods) or a GroupFuture to resolve where the data is
    needed, so calls to groups on different resource pools run at the same time."""

    def __init__(self, group: WorkerGroup, name: str, spec: MethodSpec, doc: str | None):
        self.group = group
        self.__name__ = name
        self.__doc__ = doc
        self.spec = spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.group._call(self.__name__, self.spec, args, kwargs)

    def future(self, *args: Any, **kwargs: Any) -> DataProtoFuture | GroupFuture:
        return self.group._call(self.__name__, self.spec, args, kwargs, blocking=False)


class WorkerGroup(ABC):
    """``group.method(*args)`` dispatches the arguments over the ranks, runs the method of the same
    name on every rank (or on rank 0), and collects the outputs, as the method's ``@register`` says.

    Backends (Ray) implement how a call reaches a rank and how results come back.
    """

    def _bind_methods(self, name: str, worker_cls: type, world_size: int) -> None:
        self.name = name
        self.worker_cls = worker_cls
        self.world_size = world_size
        self.layout = GroupLayout(world_size, self._fetch_mesh)
        self.method_specs = registered_methods(worker_cls)
        for method_name, spec in self.method_specs.items():
            setattr(self, method_name, self._group_method(method_name, spec))

    def _group_method(self, method_name: str, spec: MethodSpec) -> GroupMethod:
        return GroupMethod(self, method_name, spec, getattr(self.worker_cls, method_name).__doc__)

    def _call(self, method_name: str, spec: MethodSpec, args: tuple, kwargs: dict, blocking: bool | None = None) -> Any:
        mode = spec.dispatch_mode
        plan: DispatchPlan = mode.dispatch(self.layout, args, kwargs)
        if len(plan.args) != self.world_size or len(plan.kwargs) != self.world_size:
            raise ValueError(f"dispatch mode {mode.name} planned {len(plan.args)} calls for {self.world_size} ranks")
        if spec.execute_mode is Execute.RANK_ZERO:
            ranks = [0]
            collect: Callable[[list], Any] = _first
            selected_ranks = None
        else:
            ranks = list(range(self.world_size))
            collect = partial(mode.collect, spec=plan.collect)
            selected_ranks = plan.collect.ranks
        futures = [self._execute(r, method_name, plan.args[r], plan.kwargs[r]) for r in ranks]
        if spec.blocking if blocking is None else blocking:
            outputs = self._wait(method_name, futures, ranks)
            return collect(outputs if selected_ranks is None else [outputs[r] for r in selected_ranks])
        if selected_ranks is not None:
            futures, ranks = [futures[r] for r in selected_ranks], list(selected_ranks)
        if mode.returns_proto and spec.execute_mode is Execute.ALL:
            wait = partial(self._wait, method_name, ranks=ranks)
            return DataProtoFuture(collect_fn=collect, futures=futures, wait_fn=wait)
        return GroupFuture(futures, collect, partial(self._wait, method_name, ranks=ranks))

    @abstractmethod
    def _execute(self, rank: int, method_name: str, args: tuple, kwargs: dict) -> Any:
        """Start ``method_name`` on ``rank``; return a future of its output."""

    @abstractmethod
    def _wait(self, method_name: str, futures: list, ranks: list[int]) -> list:
        """The outputs of ``futures`` (those of ``ranks``), raising WorkerError as soon as any rank fails."""

    @abstractmethod
    def _fetch_mesh(self, mesh_name: str) -> list[MeshCoord]:
        """Every rank's declared coordinate in ``mesh_name``, in rank order."""
