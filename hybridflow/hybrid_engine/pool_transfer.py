"""Weights from the actor's pool to a rollout on its own pool, point to point over torch.distributed.

The two pools are separate torch.distributed worlds. A transfer group spans both: actor ranks
0..A-1 (their rank in the actor's world) and rollout ranks A..A+R-1, a gloo group (NCCL on CUDA)
built from a TCPStore that actor rank 0 hosts (``host_transfer_store``; the driver hands its address
to every rank, which calls ``join_transfer_group``). It is never the default group.

After an update every actor rank calls ``send_weights`` (the FSDP2 gather over dp is a collective of
the actor's world) and every rollout rank ``receive_weights``, following one ``TransferPlan``
(transfer_plan.py): only the plan's senders send, bucket by bucket, and each rollout rank receives
its own generation shard, nothing else. Neither side ever waits longer than ``timeout`` seconds for
one bucket: it raises ``WeightTransferStalled``, naming both sides.

Measured on torch 2.13 (CPU, gloo): ``Work.wait(timeout)`` raises RuntimeError ("Timed out waiting
N ms for recv/send operation to complete") after the timeout, for a receive with no sender and for a
send (of any size, even 40 bytes) that no one receives; it then closes that pair's connection, so a
later operation between the two ranks fails at once ("Application timeout caused pair closure"):
after a stall the group is done, join a new one under a new ``name``. Joining with a rank missing
ends in a DistStoreError after the store's timeout; connecting to an address no one listens on, in a
DistNetworkError after it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridflow.hybrid_engine.reshard import tensor_parallel_dim, unshard_data_parallel
from hybridflow.hybrid_engine.transfer_plan import (
    Bucket,
    Piece,
    TransferPlan,
    predicted_sent_bytes,
    predicted_transfer_bytes,
)

_PREFIX = "hybridflow/weight-transfer"


class WeightTransferError(RuntimeError):
    """The weight transfer between the actor's pool and the rollout's failed."""


class WeightTransferStalled(WeightTransferError):
    """One side waited ``timeout`` seconds for the other."""


class TransferJoinError(WeightTransferError):
    """The transfer group could not be formed within the timeout."""


@dataclass(frozen=True)
class TransferAddress:
    """Where actor rank 0 hosts the transfer group's store."""

    host: str
    port: int


@dataclass
class TransferReport:
    """What one rank moved in one transfer (bytes in the generation dtype) and how long it took
    (the rollout's time includes what its consumer did with the weights while they arrived)."""

    sent: int = 0
    received: int = 0
    seconds: float = 0.0
    buckets: int = 0
    predicted: float = 0.0  # what ``sent`` (actor) or ``received`` (rollout) must be, by the formulas

    def add(self, other: TransferReport) -> TransferReport:
        """This report and ``other``'s together (two transfers of one sync: a LoRA model's base, then its adapters)."""
        return TransferReport(
            sent=self.sent + other.sent,
            received=self.received + other.received,
            seconds=self.seconds + other.seconds,
            buckets=self.buckets + other.buckets,
            predicted=self.predicted + other.predicted,
        )


@dataclass
class TransferGroup:
    """This rank's view of the group spanning both pools (``backend``: its own send/recv)."""

    backend: dist.ProcessGroup
    store: dist.Store  # kept alive with the group (actor rank 0 hosts it)
    rank: int
    actors: int
    rollouts: int
    name: str

    @property
    def is_actor(self) -> bool:
        return self.rank < self.actors

    @property
    def pool_rank(self) -> int:
        """The rank within its own pool."""
        return self.rank if self.is_actor else self.rank - self.actors

    def rollout_rank(self, pool_rank: int) -> int:
        """The transfer rank of rollout rank ``pool_rank``."""
        return self.actors + pool_rank

    def describe(self) -> str:
        return f"{'actor' if self.is_actor else 'rollout'} rank {self.pool_rank}"


def host_transfer_store(*, host: str | None = None, timeout: float = 300.0) -> tuple[dist.TCPStore, TransferAddress]:
    """For actor rank 0: a TCPStore on a free port (the OS picks it) and the address the other ranks
    connect to: ``host``, by default MASTER_ADDR (the worker group sets it to actor rank 0's node address)."""
    store = dist.TCPStore("0.0.0.0", 0, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return store, TransferAddress(host or os.environ.get("MASTER_ADDR", "127.0.0.1"), store.port)


def _who(rank: int, actors: int) -> str:
    return f"actor rank {rank}" if rank < actors else f"rollout rank {rank - actors}"


def join_transfer_group(
    address: TransferAddress,
    *,
    rank: int,
    actors: int,
    rollouts: int,
    timeout: float,
    device: torch.device | str = "cpu",
    name: str = "weights",
    store: dist.Store | None = None,
) -> TransferGroup:
    """Join the transfer group ``name`` as transfer rank ``rank`` (actor ranks first, then rollout ranks):
    every rank of both pools calls this; actor rank 0 passes the ``store`` it hosts. A group's name is
    used once (its keys stay in the store). TransferJoinError when the group is not complete within
    ``timeout`` seconds, naming the ranks missing."""
    size = actors + rollouts
    me = _who(rank, actors)
    where = f"transfer group '{name}' at {address.host}:{address.port}"
    wait = timedelta(seconds=timeout)
    try:
        if store is None:
            store = dist.TCPStore(address.host, address.port, None, False, timeout=wait)
        scoped = dist.PrefixStore(f"{_PREFIX}/{name}/", store)
        scoped.set(f"joined/{rank}", "1")
        keys = [f"joined/{r}" for r in range(size)]
        try:
            scoped.wait(keys, wait)
        except dist.DistStoreError as error:
            missing = [_who(r, actors) for r, key in enumerate(keys) if not scoped.check([key])]
            raise TransferJoinError(
                f"{where}: {me} waited {timeout:g} s for {', '.join(missing) or 'the other ranks'} to join"
            ) from error
        if torch.device(device).type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = wait
            backend = dist.ProcessGroupNCCL(scoped, rank, size, options)
        else:
            backend = dist.ProcessGroupGloo(scoped, rank, size, wait)
    except TransferJoinError:
        raise
    except (RuntimeError, OSError) as error:  # DistError subclasses RuntimeError
        raise TransferJoinError(f"{where}: {me} could not join within {timeout:g} s: {error}") from error
    return TransferGroup(backend, store, rank, actors, rollouts, name)


def _wait(work: dist.Work, timeout: float, stalled: str, failed: str) -> None:
    """Work.wait with a deadline, its errors turned into the module's, with their messages."""
    start = time.perf_counter()
    try:
        done = work.wait(timedelta(seconds=timeout))
    except RuntimeError as error:
        if time.perf_counter() - start >= 0.9 * timeout or "timed out" in str(error).lower():
            raise WeightTransferStalled(stalled) from error
        raise WeightTransferError(f"{failed}: {error}") from error
    if done is False:
        raise WeightTransferStalled(stalled)


def _post(operation: Callable[..., dist.Work], buffer: torch.Tensor, peer: int, bucket: Bucket, what: str) -> dist.Work:
    """Start a send or receive; a peer already gone fails here at once (gloo: "Connection closed by peer")."""
    try:
        return operation([buffer], peer, bucket.index)
    except RuntimeError as error:
        raise WeightTransferError(f"weight transfer failed: {what} ({bucket.describe()}): {error}") from error


def _tp_local(param: torch.Tensor, dtype: torch.dtype, plan: TransferPlan, index: int, tp_index: int) -> torch.Tensor:
    """This rank's tensor-parallel shard of weight ``index`` (whole for an unsplit one) in ``dtype``:
    cast first, then gathered over dp (a collective of the actor's world, as reshard.py does)."""
    spec = plan.params[index]
    part = param.detach().to(dtype)
    split = spec.dim if plan.t > 1 else None
    if isinstance(part, DTensor):
        dim = tensor_parallel_dim(part)
        if dim != split:
            raise ValueError(
                f"{spec.name}: the training layout splits dimension {dim} over tp, the plan "
                f"(t={plan.t}, models/tensor_parallel.py) dimension {split}"
            )
        local = unshard_data_parallel(part)
    else:  # a model on one process: the tensor is whole here
        local = part if split is None else part.chunk(plan.t, dim=split)[tp_index]
    expected = list(spec.shape)
    if split is not None:
        expected[split] //= plan.t
    if list(local.shape) != expected:
        raise ValueError(f"{spec.name}: this rank holds a shard of shape {tuple(local.shape)}, the plan {expected}")
    return local


def send_weights(
    named: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    plan: TransferPlan,
    group: TransferGroup,
    *,
    timeout: float,
    in_flight: int = 2,
) -> TransferReport:
    """Send this actor rank's buckets of ``plan`` of the weights ``named`` (the plan's that this rank holds, in its
    order: the model's ``policy_parameters``, or a LoRA model's ``base_parameters`` or ``adapter_tensors``,
    engine/lora.py; in pipeline stages, those of this rank's stages); every actor rank calls it: a weight is
    gathered over dp (cast to ``dtype`` first) by all the ranks of each dp group of which some rank sends a piece
    of it.
    About ``in_flight`` buckets' bytes at most wait for their receiver at a time; each buffer lives until
    its send completes."""
    start = time.perf_counter()
    if not group.is_actor:
        raise ValueError(f"send_weights on {group.describe()}")
    _check_dtype(dtype, plan)
    rank = group.pool_rank
    tp_index = rank % plan.t
    held = plan.held_by(plan.pipeline_index(rank))
    mine = plan.sends(rank)
    number = {id(b): n for n, b in enumerate(mine, 1)}
    pieces: dict[int, list[tuple[Bucket, Piece]]] = {}  # weight -> where its blocks go
    ready: dict[int, list[Bucket]] = {}  # weight -> the buckets complete once it is copied
    for bucket in mine:
        ready.setdefault(bucket.ready, []).append(bucket)
        for piece in bucket.pieces:
            pieces.setdefault(piece.param, []).append((bucket, piece))
    if [n for n, _ in named] != [plan.params[index].name for index in held]:
        raise ValueError("the weights to send are not the plan's (names or order differ)")
    buffers: dict[int, torch.Tensor] = {}
    pending: deque[tuple[Bucket, dist.Work, torch.Tensor]] = deque()
    limit = max(1, in_flight) * plan.bucket_bytes
    report = TransferReport(predicted=_predicted_sent(plan, rank))

    def wait_oldest() -> None:
        bucket, work, _ = pending.popleft()
        where = (
            f"rollout rank {bucket.receiver} to take bucket {number[id(bucket)]} of {len(mine)} ({bucket.describe()})"
        )
        _wait(
            work,
            timeout,
            f"weight transfer stalled: actor rank {rank} waited {timeout:g} s for {where}; "
            "the rollout side stopped — its log says why",
            f"weight transfer failed: actor rank {rank}, sending to {where}; the rollout side's log may say why",
        )

    for index, (_, param) in zip(held, named):
        if not plan.needs_unshard(index, tp_index):
            continue
        while pending and (pending[0][1].is_completed() or sum(b.nbytes for b, _, _ in pending) > limit):
            wait_oldest()  # only buckets ready before this weight: never one the receiver cannot take yet
        local = _tp_local(param, dtype, plan, index, tp_index)
        for bucket, piece in pieces.get(index, []):
            buffer = buffers.get(id(bucket))
            if buffer is None:
                buffer = buffers[id(bucket)] = torch.empty(bucket.numel, dtype=dtype, device=local.device)
            block = local if piece.dim is None else local.narrow(piece.dim, piece.source, piece.length)
            buffer[piece.offset : piece.offset + piece.numel].view(piece.shape).copy_(block)
        for bucket in ready.get(index, []):
            buffer = buffers.pop(id(bucket))
            peer = group.rollout_rank(bucket.receiver)
            work = _post(
                group.backend.send,
                buffer,
                peer,
                bucket,
                f"actor rank {rank}, sending to rollout rank {bucket.receiver}",
            )
            pending.append((bucket, work, buffer))
            report.sent += bucket.nbytes
            report.buckets += 1
    while pending:
        wait_oldest()
    report.seconds = time.perf_counter() - start
    return report


def receive_weights(
    plan: TransferPlan,
    group: TransferGroup,
    report: TransferReport | None = None,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    timeout: float,
    in_flight: int = 2,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, this rollout rank's generation shard of it), each weight as soon as all its
    pieces arrived: what ``Rollout.load_weights`` takes (the slice ``TensorParallelGroup.shard`` gives).
    Receives are posted ``in_flight`` buckets ahead; ``report`` (optional) accumulates what arrived."""
    start = time.perf_counter()
    if group.is_actor:
        raise ValueError(f"receive_weights on {group.describe()}")
    _check_dtype(dtype, plan)
    report = report if report is not None else TransferReport()
    rank = group.pool_rank
    split, whole = plan.split_and_whole_bytes()
    report.predicted += predicted_transfer_bytes(split, whole, plan.tg)
    mine = plan.receives(rank)
    left: dict[int, int] = {}
    for bucket in mine:
        for piece in bucket.pieces:
            left[piece.param] = left.get(piece.param, 0) + 1
    alone = {param for param, count in left.items() if count == 1}  # one piece is the whole shard
    assembled: dict[int, torch.Tensor] = {}
    posted: deque[tuple[Bucket, dist.Work, torch.Tensor]] = deque()
    limit = max(1, in_flight) * plan.bucket_bytes
    following = 0

    def post() -> None:
        nonlocal following
        while following < len(mine) and (
            not posted or sum(b.nbytes for b, _, _ in posted) + mine[following].nbytes <= limit
        ):
            bucket = mine[following]
            buffer = torch.empty(bucket.numel, dtype=dtype, device=device)
            work = _post(
                group.backend.recv,
                buffer,
                bucket.sender,
                bucket,
                f"rollout rank {rank}, receiving from actor rank {bucket.sender}",
            )
            posted.append((bucket, work, buffer))
            following += 1

    for number in range(1, len(mine) + 1):
        post()
        bucket, work, buffer = posted.popleft()
        where = f"bucket {number} of {len(mine)} from actor rank {bucket.sender} ({bucket.describe()})"
        _wait(
            work,
            timeout,
            f"weight transfer stalled: rollout rank {rank} waited {timeout:g} s for {where}; "
            "the actor side stopped — its log says why",
            f"weight transfer failed: rollout rank {rank}, receiving {where}; the actor side's log may say why",
        )
        post()
        report.received += bucket.nbytes
        report.buckets += 1
        for piece in bucket.pieces:
            block = buffer[piece.offset : piece.offset + piece.numel].view(piece.shape)
            if piece.param in alone:
                yield piece.name, block
                continue
            shard = assembled.get(piece.param)
            if shard is None:
                shard = assembled[piece.param] = torch.empty(
                    plan.generation_shape(piece.param), dtype=dtype, device=device
                )
            shard.narrow(piece.dim, piece.target, piece.length).copy_(block)
            left[piece.param] -= 1
            if not left[piece.param]:
                yield piece.name, assembled.pop(piece.param)
    report.seconds += time.perf_counter() - start


def _check_dtype(dtype: torch.dtype, plan: TransferPlan) -> None:
    if dtype.itemsize != plan.element_size:
        raise ValueError(f"the plan is for elements of {plan.element_size} bytes, {dtype} has {dtype.itemsize}")


def _predicted_sent(plan: TransferPlan, actor_rank: int) -> float:
    """``predicted_sent_bytes`` of the weights this rank's stages hold, for its dp and tp index."""
    split, whole = plan.split_and_whole_bytes(plan.pipeline_index(actor_rank))
    dp_index, tp_index = actor_rank // (plan.pp * plan.t), actor_rank % plan.t
    return predicted_sent_bytes(
        split, whole, dp=plan.dp, t=plan.t, replicas=plan.replicas, tg=plan.tg, actor_rank=dp_index * plan.t + tp_index
    )
