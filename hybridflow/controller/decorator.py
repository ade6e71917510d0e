"""``@register``: how a worker method is reached from the driver.

A registered method carries a ``MethodSpec``: a dispatch mode (how the driver's arguments
become one set of arguments per rank, and how the ranks' outputs become one result), an
execute mode (all ranks, or rank 0 only) and whether the driver blocks on the call.

Dispatch modes are values (``DispatchMode``), registered by name; users add their own with
``register_dispatch_mode``. Dispatch and collect functions are module-level so that a
non-blocking result (which carries its collect function) can travel to other workers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from hybridflow.protocol import DataProto, DataProtoFuture, concat_and_unpad


@dataclass(frozen=True)
class MeshCoord:
    """Where one rank sits in a role's device mesh, as far as dispatch cares."""

    dp_rank: int
    dp_size: int
    is_collector: bool


class GroupLayout:
    """What a dispatch function may know of a group: its size and its ranks' mesh coordinates."""

    def __init__(self, world_size: int, fetch_mesh: Callable[[str], list[MeshCoord]]):
        self.world_size = world_size
        self._fetch_mesh = fetch_mesh
        self._meshes: dict[str, list[MeshCoord]] = {}

    def mesh(self, name: str) -> list[MeshCoord]:
        if name not in self._meshes:
            self._meshes[name] = self._fetch_mesh(name)
        return self._meshes[name]


@dataclass(frozen=True)
class CollectSpec:
    """Which ranks' outputs are collected (None: all, in rank order) and how much padding to drop."""

    ranks: tuple[int, ...] | None = None
    pad_size: int = 0


@dataclass
class DispatchPlan:
    args: list[tuple]
    kwargs: list[dict]
    collect: CollectSpec = field(default_factory=CollectSpec)


DispatchFn = Callable[[GroupLayout, tuple, dict], DispatchPlan]
CollectFn = Callable[[list, CollectSpec], Any]


@dataclass(frozen=True)
class DispatchMode:
    name: str
    dispatch: DispatchFn
    collect: CollectFn
    returns_proto: bool = False

    def __repr__(self) -> str:
        return f"DispatchMode({self.name})"


_DISPATCH_MODES: dict[str, DispatchMode] = {}


def register_dispatch_mode(
    name: str, dispatch: DispatchFn, collect: CollectFn, returns_proto: bool = False
) -> DispatchMode:
    """Add a dispatch mode usable in ``@register(dispatch_mode=...)``. Names are unique."""
    if name in _DISPATCH_MODES:
        raise ValueError(f"dispatch mode '{name}' is already registered")
    mode = DispatchMode(name, dispatch, collect, returns_proto)
    _DISPATCH_MODES[name] = mode
    return mode


def get_dispatch_mode(name: str) -> DispatchMode:
    if name not in _DISPATCH_MODES:
        raise ValueError(f"unknown dispatch mode '{name}'; known: {sorted(_DISPATCH_MODES)}")
    return _DISPATCH_MODES[name]


# ---- the built-in modes -------------------------------------------------------------------


def _broadcast(layout: GroupLayout, args: tuple, kwargs: dict) -> DispatchPlan:
    return DispatchPlan([args] * layout.world_size, [kwargs] * layout.world_size)


def _per_rank(value: Any, rank: int, world_size: int) -> Any:
    if isinstance(value, (list, tuple)) and len(value) == world_size:
        return value[rank]
    return value


def _all_to_all(layout: GroupLayout, args: tuple, kwargs: dict) -> DispatchPlan:
    """Arguments that are lists of world-size entries go one entry per rank; others go to all."""
    w = layout.world_size
    return DispatchPlan(
        [tuple(_per_rank(a, r, w) for a in args) for r in range(w)],
        [{k: _per_rank(v, r, w) for k, v in kwargs.items()} for r in range(w)],
    )


def _dp_compute(layout: GroupLayout, args: tuple, kwargs: dict) -> DispatchPlan:
    w = layout.world_size
    for position, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != w:
            raise ValueError(
                f"DP_COMPUTE needs every argument to be a list of {w} entries (one per rank); "
                f"argument {position!r} is {type(value).__name__}"
                + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
            )
    return _all_to_all(layout, args, kwargs)


def _collect_list(outputs: list, spec: CollectSpec) -> list:
    return list(outputs)


def _collect_proto(outputs: list, spec: CollectSpec) -> DataProto:
    for rank, output in enumerate(outputs):
        if not isinstance(output, DataProto):
            raise TypeError(f"a DataProto-collecting method returned {type(output).__name__} on rank {rank}")
    return concat_and_unpad(outputs, spec.pad_size)


def split_protos(args: tuple, kwargs: dict, chunks: int) -> tuple[list[tuple], list[dict], int]:
    """Split every DataProto (padded to a multiple of ``chunks``) and DataProtoFuture argument.

    Other arguments are passed whole to every chunk. Returns per-chunk args, kwargs and the padding.
    """
    values = [*args, *kwargs.values()]
    lengths = {len(v) for v in values if isinstance(v, DataProto)}
    if len(lengths) > 1:
        raise ValueError(f"DataProto arguments of one call must have equal lengths, got {sorted(lengths)}")
    pad_size = 0
    split_values = []
    for value in values:
        if isinstance(value, DataProto):
            value, pad_size = value.pad_to_divisor(chunks)
            split_values.append(value.chunk(chunks))
        elif isinstance(value, DataProtoFuture):
            split_values.append(value.chunk(chunks))
        else:
            split_values.append([value] * chunks)
    n_args = len(args)
    per_chunk_args = [tuple(parts[c] for parts in split_values[:n_args]) for c in range(chunks)]
    per_chunk_kwargs = [{k: parts[c] for k, parts in zip(kwargs, split_values[n_args:])} for c in range(chunks)]
    return per_chunk_args, per_chunk_kwargs, pad_size


def _dp_compute_proto(layout: GroupLayout, args: tuple, kwargs: dict) -> DispatchPlan:
    per_args, per_kwargs, pad = split_protos(args, kwargs, layout.world_size)
    return DispatchPlan(per_args, per_kwargs, CollectSpec(pad_size=pad))


def _dp_compute_proto_with_func(layout: GroupLayout, args: tuple, kwargs: dict) -> DispatchPlan:
    if not args or not callable(args[0]):
        raise ValueError("DP_COMPUTE_PROTO_WITH_FUNC needs a function as its first argument")
    per_args, per_kwargs, pad = split_protos(args[1:], kwargs, layout.world_size)
    return DispatchPlan([(args[0], *a) for a in per_args], per_kwargs, CollectSpec(pad_size=pad))


def _mesh_compute_proto(layout: GroupLayout, args: tuple, kwargs: dict, mesh_name: str) -> DispatchPlan:
    coords = layout.mesh(mesh_name)
    dp_size = coords[0].dp_size
    per_args, per_kwargs, pad = split_protos(args, kwargs, dp_size)
    collectors = {c.dp_rank: rank for rank, c in enumerate(coords) if c.is_collector}
    if sorted(collectors) != list(range(dp_size)):
        raise ValueError(
            f"mesh '{mesh_name}' must have exactly one collecting rank per data-parallel rank; "
            f"got collectors for dp ranks {sorted(collectors)} of {dp_size}"
        )
    return DispatchPlan(
        [per_args[c.dp_rank] for c in coords],
        [per_kwargs[c.dp_rank] for c in coords],
        CollectSpec(ranks=tuple(collectors[d] for d in range(dp_size)), pad_size=pad),
    )


def mesh_compute_proto(mesh_name: str) -> DispatchMode:
    """Dispatch by a declared device mesh: the data-parallel coordinate alone picks a rank's chunk.

    Ranks that differ only in other mesh dimensions (e.g. tensor-parallel peers) get the same
    chunk, and one rank per data-parallel group (the one its worker declared as collector) is
    collected. Workers declare the mesh with ``Worker.register_dispatch_mesh(mesh_name, ...)``.
    """
    name = f"MESH_COMPUTE_PROTO[{mesh_name}]"
    if name not in _DISPATCH_MODES:
        register_dispatch_mode(name, partial(_mesh_compute_proto, mesh_name=mesh_name), _collect_proto, True)
    return _DISPATCH_MODES[name]


class Dispatch:
    """The built-in dispatch modes."""

    ONE_TO_ALL = register_dispatch_mode("ONE_TO_ALL", _broadcast, _collect_list)
    ALL_TO_ALL = register_dispatch_mode("ALL_TO_ALL", _all_to_all, _collect_list)
    DP_COMPUTE = register_dispatch_mode("DP_COMPUTE", _dp_compute, _collect_list)
    DP_COMPUTE_PROTO = register_dispatch_mode("DP_COMPUTE_PROTO", _dp_compute_proto, _collect_proto, True)
    DP_COMPUTE_PROTO_WITH_FUNC = register_dispatch_mode(
        "DP_COMPUTE_PROTO_WITH_FUNC", _dp_compute_proto_with_func, _collect_proto, True
    )
    DP_COMPUTE_METRIC = register_dispatch_mode("DP_COMPUTE_METRIC", _dp_compute_proto, _collect_list)
    MESH_COMPUTE_PROTO = staticmethod(mesh_compute_proto)


class Execute(enum.Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    dispatch_mode: DispatchMode
    execute_mode: Execute
    blocking: bool


class RegisteredMethod:
    """A worker method reachable from the driver. Inside the worker it behaves as the plain method."""

    def __init__(self, fn: Callable, spec: MethodSpec):
        self.fn = fn
        self.spec = spec
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__
        self.__wrapped__ = fn

    def __get__(self, instance: Any, owner: type) -> Callable:
        return self.fn if instance is None else self.fn.__get__(instance, owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def register(
    dispatch_mode: DispatchMode | str = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
) -> Callable[[Callable], RegisteredMethod]:
    """Declare a worker method callable from the driver through its worker group."""
    mode = get_dispatch_mode(dispatch_mode) if isinstance(dispatch_mode, str) else dispatch_mode
    if not isinstance(mode, DispatchMode):
        raise TypeError(f"dispatch_mode must be a DispatchMode or its name, got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}")

    def wrap(fn: Callable) -> RegisteredMethod:
        return RegisteredMethod(fn, MethodSpec(mode, execute_mode, blocking))

    return wrap


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every ``@register``ed method of a class and its bases (subclasses override)."""
    methods: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, RegisteredMethod):
                methods[name] = value.spec
            elif name in methods:
                del methods[name]
    return methods
