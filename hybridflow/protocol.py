"""DataProto: the batch that travels between the driver and the worker groups.

A DataProto holds three things that share one first dimension (the batch):
  - ``batch``: a TensorDict of tensors, each (B, ...);
  - ``non_tensor_batch``: a dict of numpy object arrays, each (B,) (strings, dicts, ids);
  - ``meta_info``: a plain dict for the whole batch (temperature, step, flags).

Every operation that changes the rows (index, split, concat, repeat, reorder, pad) applies
to tensors and non-tensors alike, so the two never fall out of step.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from hybridflow.batch_keys import METRICS

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor


def _as_object_array(key: str, value: Any, length: int | None) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"non-tensor key '{key}' got a torch.Tensor; put tensors in the tensor batch")
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        array = np.empty(len(value), dtype=object)
        array[:] = list(value) if len(value) else []
    else:
        raise TypeError(f"non-tensor key '{key}' must be a numpy array or a list, got {type(value).__name__}")
    if array.ndim == 0:
        raise TypeError(f"non-tensor key '{key}' is a 0-d array; it needs one entry per sample")
    if length is not None and len(array) != length:
        raise ValueError(f"non-tensor key '{key}' has length {len(array)}, but the batch has {length} rows")
    return array


def _as_tensordict(tensors: dict[str, torch.Tensor] | TensorDict | None) -> TensorDict | None:
    if tensors is None or isinstance(tensors, TensorDict):
        return tensors
    if not tensors:
        return None
    length = None
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tensor key '{key}' must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() == 0:
            raise ValueError(f"tensor key '{key}' is a scalar; tensors need a batch dimension")
        if length is None:
            length, first_key = value.shape[0], key
        elif value.shape[0] != length:
            raise ValueError(
                f"tensor key '{key}' has {value.shape[0]} rows, but '{first_key}' has {length}; "
                "all tensors of a batch share the first dimension"
            )
    return TensorDict(dict(tensors), batch_size=[length])


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor alone: a view of a larger storage (a chunk of a batch) is copied, else torch.save writes
    the whole storage."""
    whole = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone(memory_format=torch.contiguous_format)


def _conflict(kind: str, key: str, reason: str) -> ValueError:
    return ValueError(f"union: {kind} key '{key}' is in both batches with {reason}; rename or pop one first")


@dataclass
class DataProtoItem:
    """One row of a DataProto: tensors without the batch dimension and the row's non-tensors."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, Any]
    meta_info: dict


@dataclass
class DataProto:
    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.batch = _as_tensordict(self.batch)
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(f"the tensor batch must have one batch dimension, got {tuple(self.batch.batch_size)}")
        length = self.batch.batch_size[0] if self.batch is not None else None
        arrays = {}
        for key, value in self.non_tensor_batch.items():
            arrays[key] = _as_object_array(key, value, length)
            length = len(arrays[key]) if length is None else length
        self.non_tensor_batch = arrays
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        return cls(batch=tensors, non_tensor_batch=dict(non_tensors or {}), meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
        """Split one dict by value type: tensors into ``batch``, everything else into ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, others, meta_info)

    # ---- size and access ----------------------------------------------------------------

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for array in self.non_tensor_batch.values():
            return len(array)
        return 0

    def __getitem__(self, index: Index) -> DataProto | DataProtoItem:
        if isinstance(index, (int, np.integer)):
            position = int(index)
            if not -len(self) <= position < len(self):
                raise IndexError(f"index {position} out of range for a DataProto of {len(self)} rows")
            return DataProtoItem(
                batch=self.batch[position] if self.batch is not None else None,
                non_tensor_batch={k: v[position] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(index, slice):
            return self._take(index, np.arange(len(self))[index])
        positions = self._positions(index)
        return self._take(torch.as_tensor(positions), positions)

    def _positions(self, index: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        positions = index.cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if positions.dtype == bool:
            if len(positions) != len(self):
                raise IndexError(f"boolean mask of length {len(positions)} for {len(self)} rows")
            positions = np.nonzero(positions)[0]
        if positions.size and not np.issubdtype(positions.dtype, np.integer):
            raise TypeError(f"indices must be integers, got dtype {positions.dtype}")
        return positions.astype(np.int64)

    def _take(self, tensor_index: slice | torch.Tensor, array_index: np.ndarray) -> DataProto:
        return DataProto(
            batch=self.batch[tensor_index] if self.batch is not None else None,
            non_tensor_batch={k: v[array_index] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def check_consistency(self) -> None:
        length = len(self)
        for key, array in self.non_tensor_batch.items():
            if len(array) != length:
                raise ValueError(f"non-tensor key '{key}' has length {len(array)}, but the batch has {length} rows")

    # ---- keys ---------------------------------------------------------------------------

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the named keys (None keeps all of that kind)."""
        batch = self.batch
        if batch_keys is not None:
            self._require(batch_keys, self.batch.keys() if self.batch is not None else [], "tensor")
            batch = self.batch.select(*batch_keys) if batch_keys else None
        non_tensors = self._subset(self.non_tensor_batch, non_tensor_batch_keys, "non-tensor")
        meta = self._subset(self.meta_info, meta_info_keys, "meta_info")
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensors, meta = copy.deepcopy(non_tensors), copy.deepcopy(meta)
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def pop(
        self,
        batch_keys: Sequence[str] = (),
        non_tensor_batch_keys: Sequence[str] = (),
        meta_info_keys: Sequence[str] = (),
    ) -> DataProto:
        """Remove the named keys from this DataProto and return them as a new one."""
        self._require(batch_keys, self.batch.keys() if self.batch is not None else [], "tensor")
        self._require(non_tensor_batch_keys, self.non_tensor_batch, "non-tensor")
        self._require(meta_info_keys, self.meta_info, "meta_info")
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        if self.batch is not None and not list(self.batch.keys()):
            self.batch = None
        return DataProto.from_dict(tensors, non_tensors, meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename tensor keys in place (returns self for chaining)."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename got {len(old_keys)} old keys but {len(new_keys)} new keys")
        self._require(old_keys, self.batch.keys() if self.batch is not None else [], "tensor")
        values = [self.batch.pop(k) for k in old_keys]
        for key, value in zip(new_keys, values):
            self.batch.set(key, value)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into this DataProto in place. Shared keys must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"union: batches have different lengths ({len(self)} and {len(other)})")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch
            else:
                for key, value in other.batch.items():
                    if key in self.batch.keys():
                        mine = self.batch[key]
                        if mine.shape != value.shape or not torch.equal(mine, value):
                            raise _conflict("tensor", key, "different values")
                    else:
                        self.batch.set(key, value)
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch:
                mine = self.non_tensor_batch[key]
                if len(mine) != len(value) or any(a != b for a, b in zip(mine.tolist(), value.tolist())):
                    raise _conflict("non-tensor", key, "different values")
            else:
                self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key in self.meta_info and self.meta_info[key] != value:
                raise _conflict("meta_info", key, f"different values ({self.meta_info[key]!r} vs {value!r})")
            self.meta_info[key] = value
        self.check_consistency()
        return self

    @staticmethod
    def _require(keys: Sequence[str], present: Any, kind: str) -> None:
        present = list(present)
        missing = [k for k in keys if k not in present]
        if missing:
            raise KeyError(f"{kind} key(s) {missing} not in the DataProto; it has {sorted(present)}")

    @classmethod
    def _subset(cls, source: dict, keys: Sequence[str] | None, kind: str) -> dict:
        if keys is None:
            return dict(source)
        cls._require(keys, source, kind)
        return {k: source[k] for k in keys}

    # ---- splitting and joining ----------------------------------------------------------

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` equal parts, in order. The length must divide (see ``pad_to_divisor``)."""
        if chunks <= 0 or len(self) % chunks:
            raise ValueError(
                f"cannot chunk {len(self)} rows into {chunks} equal parts; "
                "pad_to_divisor() first, or use split() for unequal parts"
            )
        return self.split(len(self) // chunks) if len(self) else [self[0:0] for _ in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows; the last one may be shorter."""
        if split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        return [self[start : start + split_size] for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Rows of all parts in order. meta_info comes from the first part."""
        if not parts:
            raise ValueError("concat needs at least one DataProto")
        key_sets = {tuple(sorted(p.non_tensor_batch)) for p in parts}
        if len(key_sets) > 1:
            raise ValueError(f"concat: parts have different non-tensor keys {sorted(key_sets)}")
        batches = [p.batch for p in parts]
        if any(b is None for b in batches) and not all(b is None for b in batches):
            raise ValueError("concat: some parts have tensors and some do not")
        batch = None if batches[0] is None else torch.cat(batches, dim=0)
        non_tensors = {
            key: np.concatenate([p.non_tensor_batch[key] for p in parts]) for key in parts[0].non_tensor_batch
        }
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(parts[0].meta_info))

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Repeat rows: interleaved gives a,a,b,b; tiled gives a,b,a,b."""
        order = np.arange(len(self))
        order = np.repeat(order, repeat_times) if interleave else np.tile(order, repeat_times)
        return self[order]

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Permute the rows in place: row i becomes the old row ``indices[i]``."""
        reordered = self[self._positions(indices)]
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        return self

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Append copies of the first rows until the length divides by ``divisor``."""
        pad_size = (-len(self)) % divisor
        if pad_size == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("cannot pad an empty DataProto")
        filler = np.arange(pad_size) % len(self)
        return DataProto.concat([self, self[filler]]), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        return self[: len(self) - pad_size] if pad_size else self

    # ---- devices, disk, iteration -------------------------------------------------------

    def to(self, device: str | torch.device) -> DataProto:
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def save_to_disk(self, path: str | Path) -> None:
        Path(path).write_bytes(pickle.dumps(self))

    @staticmethod
    def load_from_disk(path: str | Path) -> DataProto:
        data = pickle.loads(Path(path).read_bytes())
        if not isinstance(data, DataProto):
            raise TypeError(f"{path} holds a {type(data).__name__}, not a DataProto")
        return data

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, shuffle: bool = False, seed: int | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` rows for ``epochs`` passes; the length must divide.

        With ``shuffle`` each epoch draws a fresh permutation from one generator seeded by ``seed``,
        so the same seed always yields the same sequence of mini-batches.
        """
        if mini_batch_size <= 0 or len(self) % mini_batch_size:
            raise ValueError(f"mini_batch_size {mini_batch_size} does not divide the batch of {len(self)} rows")
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        for _ in range(epochs):
            data = self[torch.randperm(len(self), generator=generator)] if shuffle else self
            yield from data.split(mini_batch_size)

    # ---- pickling (Ray) -----------------------------------------------------------------

    def __getstate__(self) -> dict:
        """Tensors go through torch.save as whole buffers: no per-element work on the hot path."""
        buffer = io.BytesIO()
        tensors = None if self.batch is None else {k: _compact(v) for k, v in self.batch.items()}
        torch.save(tensors, buffer)
        return {"batch": buffer.getvalue(), "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict) -> None:
        tensors = torch.load(io.BytesIO(state["batch"]), weights_only=True)
        self.batch = None if tensors is None else _as_tensordict(tensors)
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def __repr__(self) -> str:
        tensors = {k: tuple(v.shape) for k, v in self.batch.items()} if self.batch is not None else {}
        return (
            f"DataProto(len={len(self)}, tensors={tensors}, "
            f"non_tensors={sorted(self.non_tensor_batch)}, meta_info={sorted(self.meta_info)})"
        )


# ---- futures ------------------------------------------------------------------------------


def _select_chunk(data: DataProto, chunks: int, index: int) -> DataProto:
    if len(data) % chunks:
        raise ValueError(
            f"a DataProtoFuture of {len(data)} rows cannot be split evenly over {chunks} workers; "
            "size the batch to a multiple of the world size, or call .get() on the driver to pad it"
        )
    return data.chunk(chunks)[index]


def mean_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the ranks that reported it."""
    collected: dict[str, list[float]] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            collected.setdefault(key, []).append(float(value))
    return {key: sum(values) / len(values) for key, values in collected.items()}


def concat_and_unpad(outputs: list[DataProto], pad_size: int = 0) -> DataProto:
    """The ranks' outputs as one batch, in rank order. Their measurements (``meta_info[METRICS]``,
    the one way workers report metrics) become the mean over ranks."""
    merged = DataProto.concat(outputs).unpad(pad_size)
    per_rank = [output.meta_info[METRICS] for output in outputs if METRICS in output.meta_info]
    if per_rank:
        merged.meta_info[METRICS] = mean_metrics(per_rank)
    return merged


@dataclass
class DataProtoFuture:
    """A DataProto that some worker group is still computing.

    It holds Ray object references to each rank's output and how to collect them. Passing it
    into another group's method sends only the references: each receiving worker resolves
    them itself, so the driver never waits for nor holds the data.
    """

    collect_fn: Callable[[list[DataProto]], DataProto]
    futures: list[Any]
    dispatch_fn: Callable[[DataProto], DataProto] | None = None
    # the producing group's wait on the driver: a failed rank becomes a WorkerError naming it (not
    # sent to workers, which resolve with plain ray.get)
    wait_fn: Callable[[list[Any]], list[DataProto]] | None = None

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        if self.dispatch_fn is not None:
            raise ValueError("this DataProtoFuture is already one chunk of another; call .get() to split further")
        return [
            DataProtoFuture(self.collect_fn, self.futures, partial(_select_chunk, chunks=chunks, index=i))
            for i in range(chunks)
        ]

    def get(self) -> DataProto:
        import ray

        outputs = self.wait_fn(self.futures) if self.wait_fn is not None else ray.get(self.futures)
        data = self.collect_fn(outputs)
        return self.dispatch_fn(data) if self.dispatch_fn is not None else data

    def __getstate__(self) -> dict:
        return {**self.__dict__, "wait_fn": None}


def materialize(value: Any) -> Any:
    """Resolve a DataProtoFuture (as a worker does on receiving one); other values pass through."""
    return value.get() if isinstance(value, DataProtoFuture) else value
