"""Which weights go from which actor rank to which rollout rank after an update: a plan, no communication.

The actor trains on dp x t ranks (rank = dp_index * t + tp_index; tensor-parallel shard i of a split
weight covers [i·D/t, (i+1)·D/t) of its split dimension, of size D). The rollout, on its own pool,
generates on R = replicas x tg ranks: rollout rank r holds generation shard j = r % tg, covering
[j·D/tg, (j+1)·D/tg), of replica p = r // tg. Neither of t and tg need divide the other: rollout rank
r receives, for every split weight, the overlap of its generation shard with each training shard, from
the actor rank with dp index p % dp (the replicas are spread over the actor's dp replicas) and that
tp index; a weight that is not split comes whole from tp index j % t.

With pipeline stages (pp > 1, actor rank = (dp_index * pp + pp_index) * t + tp_index) a weight lives on the pp
ranks of its stage only (``ParamSpec.holder``): it comes from the actor rank of that pp index, the dp index and tp
index being chosen as above. A rank sends only the weights of its own stages, so each sender's buckets still follow
the order in which it gathers them.

A (sender, receiver) pair exchanges at most one piece per weight, in weight order, packed into buckets
of at most ``bucket_bytes`` (a piece larger than that is a bucket alone). Every bucket is "ready" once
its sender has gathered its last weight. The plan's buckets are in one order, by (ready, sender,
receiver, index): senders send and receivers receive in it, and no sender ever waits on a bucket that
is ready after the weight it is gathering, so neither side can deadlock (pool_transfer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from math import prod

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.engine.lora import adapter_tensors, base_parameters
from hybridflow.engine.pipeline import PipelinedModel
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models.tensor_parallel import LAYER_SPLITS, UNSPLIT

DEFAULT_BUCKET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ParamSpec:
    """One weight as the actor's model names it: its full (Hugging Face) shape, the dimension that
    tensor parallelism splits (None: every tp rank holds it whole) and the pp index of the ranks holding it (its
    pipeline stage's; 0 without stages)."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    holder: int = 0

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """A block of one weight: ``length`` slices along ``dim`` starting at ``source`` in the sender's
    tensor-parallel shard and at ``target`` in the receiver's generation shard (an unsplit weight, dim
    None, is one whole block: the three are 0); it lies flat at ``offset`` (elements) in its bucket."""

    param: int  # index into TransferPlan.params
    name: str
    dim: int | None
    source: int
    target: int
    length: int
    shape: tuple[int, ...]  # the block's own shape
    offset: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """One flat buffer from actor rank ``sender`` to rollout rank ``receiver`` (ranks within their pools)."""

    sender: int
    receiver: int
    index: int  # its place among the buckets of its (sender, receiver) pair: the message tag
    pieces: tuple[Piece, ...]
    element_size: int

    @property
    def ready(self) -> int:
        """The weight after whose gathering the sender can send it."""
        return self.pieces[-1].param

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def describe(self) -> str:
        """The weights it carries, for error messages: 'first..last' or the one name."""
        first, last = self.pieces[0].name, self.pieces[-1].name
        return first if first == last else f"{first}..{last}"


@dataclass(frozen=True)
class TransferPlan:
    """Every bucket of one actor-to-rollout weight transfer, in the order both sides follow."""

    dp: int
    pp: int
    t: int
    replicas: int
    tg: int
    element_size: int
    bucket_bytes: int
    params: tuple[ParamSpec, ...]
    buckets: tuple[Bucket, ...]
    _unsharded: frozenset[tuple[int, int]] = field(repr=False, default=frozenset())

    @property
    def actors(self) -> int:
        return self.dp * self.pp * self.t

    def pipeline_index(self, actor_rank: int) -> int:
        """The pp index of ``actor_rank``: which stages' weights it holds."""
        return actor_rank // self.t % self.pp

    def held_by(self, pp_index: int) -> list[int]:
        """The weights the actor ranks of pp index ``pp_index`` hold (all of them without stages), in order."""
        return [index for index, spec in enumerate(self.params) if spec.holder == pp_index]

    @property
    def rollouts(self) -> int:
        return self.replicas * self.tg

    def sends(self, actor_rank: int) -> list[Bucket]:
        """The buckets ``actor_rank`` sends, in the order it sends them."""
        return [b for b in self.buckets if b.sender == actor_rank]

    def receives(self, rollout_rank: int) -> list[Bucket]:
        """The buckets ``rollout_rank`` receives, in the order it receives them."""
        return [b for b in self.buckets if b.receiver == rollout_rank]

    def sent_bytes(self, actor_rank: int) -> int:
        return sum(b.nbytes for b in self.sends(actor_rank))

    def received_bytes(self, rollout_rank: int) -> int:
        return sum(b.nbytes for b in self.receives(rollout_rank))

    def needs_unshard(self, param: int, tp_index: int) -> bool:
        """Whether some actor rank of tp index ``tp_index`` sends a piece of weight ``param``; the dp
        group of those ranks (all of them share that tp index) gathers it only then, all or none."""
        return (param, tp_index) in self._unsharded

    def generation_shape(self, param: int) -> tuple[int, ...]:
        """The shape of weight ``param`` in a rollout rank's generation shard."""
        spec = self.params[param]
        if spec.dim is None:
            return spec.shape
        shape = list(spec.shape)
        shape[spec.dim] //= self.tg
        return tuple(shape)

    def split_and_whole_bytes(self, pp_index: int | None = None) -> tuple[int, int]:
        """Bytes of the split weights and of the unsplit ones, whole, in the generation dtype: of all of them, or
        of those the ranks of ``pp_index`` hold."""
        params = [p for p in self.params if pp_index is None or p.holder == pp_index]
        split = sum(p.numel for p in params if p.dim is not None) * self.element_size
        whole = sum(p.numel for p in params if p.dim is None) * self.element_size
        return split, whole


def predicted_transfer_bytes(split_bytes: float, whole_bytes: float, tg: int) -> float:
    """Bytes one rollout rank receives: its 1/tg of the split weights and every unsplit weight whole."""
    return split_bytes / tg + whole_bytes


def predicted_sent_bytes(
    split_bytes: float, whole_bytes: float, *, dp: int, t: int, replicas: int, tg: int, actor_rank: int
) -> float:
    """Bytes actor rank (d, i) = (actor_rank // t, actor_rank % t) sends: for each replica it serves
    (p ≡ d mod dp) its whole tp shard of the split weights (the replica's tg generation shards cover
    it once) and the unsplit weights once per generation shard j with j % t = i. With pipeline stages, ``d`` is
    the rank's dp index, and the bytes are those of the weights its stages hold."""
    d, i = divmod(actor_rank, t)
    served = len(range(d, replicas, dp))
    whole_copies = len(range(i, tg, t))
    return served * (split_bytes / t + whole_bytes * whole_copies)


def _specs(model: nn.Module, named: Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]]) -> list[ParamSpec]:
    """``named(model)``'s tensors as ParamSpecs, each split as its family's table says; a pipelined model's, every
    stage's with its holder, the same list on every rank (a collective of the pp group). A family without a table (a
    mixture of experts) travels unsplit: tensor parallelism is refused for it on both sides before a run starts."""
    split = LAYER_SPLITS.get(model.config.model_type, UNSPLIT)
    if not isinstance(model, PipelinedModel):
        return [ParamSpec(name, tuple(p.shape), split.shard_dim(name)) for name, p in named(model)]
    mine = {stage: [(name, tuple(t.shape)) for name, t in model.stage_named(named, stage)] for stage in model.indices}
    every: list = [None] * model.pp_size
    dist.all_gather_object(every, mine, group=model.group)
    held = {stage: (pp_index, names) for pp_index, stages in enumerate(every) for stage, names in stages.items()}
    specs = []
    for stage in range(model.num_stages):
        pp_index, names = held[stage]
        specs.extend(ParamSpec(name, shape, split.shard_dim(name), pp_index) for name, shape in names)
    return specs


def transfer_params(model: nn.Module) -> list[ParamSpec]:
    """The parameter list of a Hugging Face model (full shapes, also of DTensors or on the meta device; of a LoRA
    model its base, engine/lora.py ``base_parameters``, the weights its first transfer sends), with each weight's
    split dimension from its family's table (models/tensor_parallel.py) and, in pipeline stages, its holder."""
    return _specs(model, base_parameters)


def adapter_transfer_params(model: nn.Module) -> list[ParamSpec]:
    """A LoRA model's adapters as they travel (models/adapters.py), in the model's order, each split as its
    family's table splits it (B A splits as the layer's weight: B by rows in a column-split layer, A by columns
    in a row-split one; the other whole)."""
    return _specs(model, adapter_tensors)


def _overlap(lo: int, hi: int, lo2: int, hi2: int) -> tuple[int, int] | None:
    start, end = max(lo, lo2), min(hi, hi2)
    return (start, end) if start < end else None


def _blocks(spec: ParamSpec, t: int, tg: int, j: int) -> list[tuple[int, int, int, int]]:
    """(tp index, start in its shard, start in generation shard j, length) of each block of generation
    shard j of one weight; for an unsplit weight, the whole tensor from tp index j % t."""
    if spec.dim is None:
        return [(j % t, 0, 0, 0)]
    size = spec.shape[spec.dim]
    if size % t or size % tg:
        raise ValueError(
            f"{spec.name}: dimension {spec.dim} of size {size} must be divisible by both the training "
            f"tensor-parallel size t={t} and the generation one tg={tg}"
        )
    train, gen = size // t, size // tg
    blocks = []
    for i in range(t):
        span = _overlap(i * train, (i + 1) * train, j * gen, (j + 1) * gen)
        if span is not None:
            blocks.append((i, span[0] - i * train, span[0] - j * gen, span[1] - span[0]))
    return blocks


def _block_shape(spec: ParamSpec, length: int) -> tuple[int, ...]:
    if spec.dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.dim] = length
    return tuple(shape)


def _pack(sender: int, receiver: int, pieces: Iterable[Piece], element_size: int, bucket_bytes: int) -> list[Bucket]:
    """The pair's pieces, in weight order, cut into buckets of at most ``bucket_bytes``."""
    buckets: list[Bucket] = []
    current: list[Piece] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            buckets.append(Bucket(sender, receiver, len(buckets), tuple(current), element_size))
        current, size = [], 0

    for piece in pieces:
        nbytes = piece.numel * element_size
        if current and size + nbytes > bucket_bytes:
            close()
        current.append(replace(piece, offset=size // element_size))
        size += nbytes
    close()
    return buckets


def plan_transfer(
    actor: LayoutShape,
    *,
    replicas: int,
    tg: int,
    params: Sequence[ParamSpec | tuple[str, tuple[int, ...], int | None]],
    element_size: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> TransferPlan:
    """The transfer from ``actor``'s training layout (its dp, pp and t; its tg is not used) to ``replicas``
    rollout replicas of ``tg`` ranks each, of ``params`` in the actor's parameter order, in a dtype of
    ``element_size`` bytes. ValueError for a split weight whose dimension t or tg does not divide, or a holder
    outside the pp ranks."""
    if replicas < 1 or tg < 1:
        raise ValueError(f"a rollout of {replicas} replicas x tg={tg} ranks")
    if bucket_bytes < 1 or element_size < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} and element_size={element_size} must be positive")
    specs = tuple(p if isinstance(p, ParamSpec) else ParamSpec(p[0], tuple(p[1]), p[2]) for p in params)
    dp, pp, t = actor.fsdp, actor.pp, actor.t  # dp: the ranks holding FSDP shards (sequence-parallel ones too)
    outside = [spec for spec in specs if not 0 <= spec.holder < pp]
    if outside:
        raise ValueError(f"{outside[0].name}: held by pp index {outside[0].holder}, but the actor has pp={pp}")
    pairs: dict[tuple[int, int], list[Piece]] = {}
    for receiver in range(replicas * tg):
        replica, j = divmod(receiver, tg)
        for index, spec in enumerate(specs):
            for tp_index, source, target, length in _blocks(spec, t, tg, j):
                sender = ((replica % dp) * pp + spec.holder) * t + tp_index
                piece = Piece(index, spec.name, spec.dim, source, target, length, _block_shape(spec, length), 0)
                pairs.setdefault((sender, receiver), []).append(piece)
    buckets = [
        bucket
        for (sender, receiver), pieces in pairs.items()
        for bucket in _pack(sender, receiver, pieces, element_size, bucket_bytes)
    ]
    buckets.sort(key=lambda b: (b.ready, b.sender, b.receiver, b.index))
    unsharded = frozenset((p.param, b.sender % t) for b in buckets for p in b.pieces)
    return TransferPlan(dp, pp, t, replicas, tg, element_size, bucket_bytes, specs, tuple(buckets), unsharded)
