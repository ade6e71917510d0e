"""Forward passes over a batch's response tokens: log-probs, entropy, values.

Every pass reads ``input_ids``, ``attention_mask``, ``position_ids`` (B, P+R) and ``responses``
(B, R), and returns values for the R response positions only: the token at position P+t is
predicted by the logits at P+t-1. All passes share this masking, so log-probs from the rollout,
the actor, the reference and the values line up token for token.

With ``remove_padding`` the model runs on the packed real tokens (``packing.py``), the LM head and
the log-prob/entropy math only on the real response tokens, and the results come back in the
same (B, R) layout, with 0 on response padding; on real tokens they equal the padded pass. The
batched (no-grad) passes form micro-batches of a fixed number of rows, or with ``max_token_len``
of at most that many real tokens (``dynamic_batch.py``), and return rows in the batch's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms import entropy_from_logits, log_probs_from_logits
from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSES, ROUTED_EXPERTS
from hybridflow.engine.dynamic_batch import micro_batch_groups, restore_order, split_by_groups
from hybridflow.engine.packing import (
    PackedBatch,
    SequenceShards,
    accepts_logits_to_keep,
    pack,
    packed_forward,
    real_in_slice,
    sequence_slice,
)
from hybridflow.engine.pipeline import PipelinedModel
from hybridflow.engine.sequence_parallel import ResponseShard, all_gather_slices, sp_size
from hybridflow.lengths import PromptSharing, prompt_sharing, row_lengths
from hybridflow.models.routing import RouteReplay, replaying_routes, routes_into, rows_of_tokens
from hybridflow.protocol import DataProto


def packed_prompt_sharing(data: DataProto, remove_padding: bool) -> PromptSharing | None:
    """Which rows share a prompt, for micro-batches that keep them together: only a packed pass computes it once."""
    return prompt_sharing(data) if remove_padding else None


class ResponseOutputs(NamedTuple):
    """The model's outputs that predict the response tokens (``response_outputs``): ``logits`` (B, R, C) padded, or
    (M, C) at the M real response tokens packed; where they go ((B, R) mask, None padded); and under sequence
    parallelism, which of them this rank computed (None: all)."""

    logits: torch.Tensor
    valid: torch.Tensor | None
    shard: ResponseShard | None


def sp_of_packed(sp_group: dist.ProcessGroup | None, remove_padding: bool) -> int:
    """The ranks of ``sp_group``; ValueError for a padded pass under sequence parallelism (it splits packed rows)."""
    sp = sp_size(sp_group)
    if sp > 1 and not remove_padding:
        raise ValueError("sequence parallelism runs on packed rows: set use_remove_padding=true")
    return sp


def response_outputs(
    model: nn.Module,
    batch: DataProto,
    remove_padding: bool = False,
    sp_group: dist.ProcessGroup | None = None,
    replay_routes: RouteReplay | None = None,
    record_routes: list[torch.Tensor] | None = None,
) -> ResponseOutputs:
    """The model's outputs (``.logits``) that predict the response tokens, where they go, and whose they are.

    Padded: (B, R, C) for every response position, None, None. Packed: (M, C) for the M real response tokens only
    (row-major over (B, R)), their (B, R) mask, and None; a causal LM's head then runs on those M positions only
    (``logits_to_keep``), not on the prompts and padding. With ``sp_group`` (Ulysses, packed only): this rank runs
    its slice of the packed tokens and gives the outputs among the M that fall in it (``ResponseShard.mine``).
    ``replay_routes``: a mixture of experts routes each token through the batch's ``routed_experts`` where it has them,
    counted there (models/routing.py). ``record_routes``: a list that receives the experts each token was routed to,
    (B, P+R, L, k) in the batch's layout (-1 on padding). Under sequence parallelism each rank routes its slice of the
    tokens (replayed: through its slice of the routes) and the recorded slices are gathered.
    """
    tensors = batch.batch
    response_length = tensors[RESPONSES].shape[1]
    sp = sp_of_packed(sp_group, remove_padding)
    routes = tensors[ROUTED_EXPERTS] if replay_routes is not None and ROUTED_EXPERTS in tensors.keys() else None
    mask = tensors[ATTENTION_MASK]
    if not remove_padding:
        inputs = {key: tensors[key] for key in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)}

        def to_rows(recorded: torch.Tensor) -> torch.Tensor:  # the forward's tokens are the batch's slots, row-major
            return rows_of_tokens(recorded, torch.arange(mask.numel(), device=mask.device).view(mask.shape), mask)

        with (
            replaying_routes(model, None if routes is None else routes.flatten(0, 1), replay_routes),
            routes_into(model, record_routes, to_rows),
        ):
            logits = model(**inputs, use_cache=False).logits
        return ResponseOutputs(logits[:, -response_length - 1 : -1, :], None, None)
    packed, keep = packed_responses(batch)
    routes = None if routes is None else routes[packed.kept]
    to_rows = lambda recorded: rows_of_tokens(recorded, packed.token_position, mask)  # noqa: E731
    if sp > 1:
        outputs, shard = _sharded_outputs(model, packed, keep, sp_group, routes, replay_routes, record_routes, to_rows)
        return ResponseOutputs(outputs, packed.response_valid, shard)
    with replaying_routes(model, routes, replay_routes), routes_into(model, record_routes, to_rows):
        if accepts_logits_to_keep(model):
            outputs = packed_forward(model, packed, logits_to_keep=keep)[0]
        else:
            outputs = packed_forward(model, packed)[0, keep]
    return ResponseOutputs(outputs, packed.response_valid, None)


def packed_responses(batch: DataProto) -> tuple[PackedBatch, torch.Tensor]:
    """``batch``'s rows packed, and the (M,) packed positions whose outputs predict the real response tokens (rows
    sharing a prompt share its last one)."""
    tensors = batch.batch
    packed = pack(tensors[INPUT_IDS], tensors[ATTENTION_MASK], tensors[POSITION_IDS], tensors[RESPONSES].shape[1])
    return packed, packed.response_index[packed.response_valid]


def local_slice(packed: PackedBatch, group: dist.ProcessGroup) -> tuple[PackedBatch, SequenceShards, int]:
    """This rank's slice of the packed tokens (every rank's as long: the sequence padded to a multiple of sp), the
    shards the attention exchanges over, and the slice's first packed position."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    total = packed.input_ids.shape[1]
    per_rank = -(-total // sp)
    start = rank * per_rank

    def mine(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(x, (0, per_rank * sp - total))[:, start : start + per_rank]

    local = dataclasses.replace(packed, input_ids=mine(packed.input_ids), position_ids=mine(packed.position_ids))
    return local, SequenceShards(group, total, per_rank * sp), start


def _sharded_outputs(
    model: nn.Module,
    packed: PackedBatch,
    keep: torch.Tensor,
    group: dist.ProcessGroup,
    routes: torch.Tensor | None = None,
    replay: RouteReplay | None = None,
    record: list[torch.Tensor] | None = None,
    to_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ResponseShard]:
    """This rank's slice of the packed tokens through the model, and its outputs among ``keep``; ``routes``: the
    packed tokens' recorded experts (N, L, k), replayed on the slice's (the padding that evens the slices routes
    itself); ``record``: receives the routes taken, every rank's slice gathered and laid out by ``to_rows``."""
    local, shards, start = local_slice(packed, group)
    width = local.input_ids.shape[1]
    held = (keep >= start) & (keep < start + width)
    if routes is not None:
        routes = nn.functional.pad(routes, (0, 0, 0, 0, 0, shards.padded - routes.shape[0]), value=-1)
        routes = routes[start : start + width]

    def gathered_rows(recorded: torch.Tensor) -> torch.Tensor:  # every rank's slice, in the packed order
        return to_rows(all_gather_slices(recorded, group))

    with replaying_routes(model, routes, replay), routes_into(model, record, gathered_rows):
        if accepts_logits_to_keep(model):
            outputs = packed_forward(model, local, logits_to_keep=keep[held] - start, shards=shards)[0]
        else:
            outputs = packed_forward(model, local, shards=shards)[0, keep[held] - start]
    return outputs, ResponseShard(held, group, shards.real_in(start, width))


def _to_rows(values: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Per-token values back to the (B, R) layout: (M,) at ``valid``, 0 elsewhere; padded values pass through."""
    if valid is None:
        return values
    return torch.zeros(valid.shape, dtype=values.dtype, device=values.device).masked_scatter(valid, values)


def response_log_probs(
    model: nn.Module,
    batch: DataProto,
    temperature: float = 1.0,
    with_entropy: bool = False,
    remove_padding: bool = False,
    entropy_grad: bool = True,
    sp_group: dist.ProcessGroup | None = None,
    replay_routes: RouteReplay | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log pi(response token), entropy or None), each (B, R) in fp32; 0 on response padding when packed.

    ``entropy_grad=False``: the entropy is a metric only, computed outside the autograd graph. ``sp_group``: Ulysses
    sequence parallelism over its ranks (every rank gets every row's values). ``replay_routes``: through the batch's
    recorded experts.
    """
    outputs = response_outputs(model, batch, remove_padding, sp_group, replay_routes)
    return log_probs_of(outputs, batch, temperature, with_entropy, entropy_grad)


def log_probs_of(
    outputs: ResponseOutputs,
    batch: DataProto,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_log_probs`` from the model's outputs on ``batch``."""
    logits, valid, shard = outputs
    if temperature != 1.0:
        logits = logits / temperature
    responses = batch.batch[RESPONSES]
    labels = responses if valid is None else responses[valid]
    whole = (lambda x: x) if shard is None else shard.whole
    if shard is not None:
        labels = labels[shard.mine]
    log_probs = _to_rows(whole(log_probs_from_logits(logits, labels)), valid)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = _to_rows(whole(entropy_from_logits(logits)), valid)
    return log_probs, entropy


def response_values(
    model: nn.Module, batch: DataProto, remove_padding: bool = False, sp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Critic values V(s_t) of the state before each response token: (B, R) in fp32."""
    return values_of(response_outputs(model, batch, remove_padding, sp_group))


def values_of(outputs: ResponseOutputs) -> torch.Tensor:
    """``response_values`` from the model's outputs ((B, R, 1) or (M, 1))."""
    values, valid, shard = outputs
    values = values[..., 0].float()
    return _to_rows(values if shard is None else shard.whole(values), valid)


def _batched(
    model: nn.Module,
    of_outputs: Callable[[DataProto, ResponseOutputs], torch.Tensor | tuple],
    data: DataProto,
    micro_batch_size: int,
    remove_padding: bool,
    max_token_len: int | None,
    sp_group: dist.ProcessGroup | None,
    replay_routes: RouteReplay | None = None,
    record_routes: list[torch.Tensor] | None = None,
) -> tuple[list, list[list[int]]]:
    """``of_outputs`` of each micro-batch's ``response_outputs`` (``micro_batch_size`` rows, or with ``max_token_len``
    at most that many real tokens: a collective under data parallelism, every rank runs as many), and the groups, for
    ``restore_order``. A pipelined model runs every micro-batch through its stages in one schedule, and every rank of
    its pp group gets the results of the last stage. ``replay_routes``: ``response_outputs``'; ``record_routes``: each
    micro-batch's routes, in its rows' order (``restore_order`` puts them back)."""
    sharing = packed_prompt_sharing(data, remove_padding)
    groups = micro_batch_groups(row_lengths(data), micro_batch_size, max_token_len, sharing)
    micro_batches = split_by_groups(data, groups)
    if isinstance(model, PipelinedModel):
        recorded = [] if record_routes is not None else None
        outputs = pipelined_outputs(
            model, micro_batches, remove_padding, sp_group, replay=replay_routes, record_routes=recorded
        )
        parts = None if outputs is None else [of_outputs(m, o) for m, o in zip(micro_batches, outputs)]
        parts, recorded = model.share_from_last((parts, recorded))
        if record_routes is not None:
            record_routes.extend(recorded)
        return parts, groups
    outputs = (
        response_outputs(model, m, remove_padding, sp_group, replay_routes, record_routes) for m in micro_batches
    )
    return [of_outputs(m, o) for m, o in zip(micro_batches, outputs)], groups


def check_pipelined(remove_padding: bool) -> None:
    if not remove_padding:
        raise ValueError("pipeline parallelism runs on packed rows: set use_remove_padding=true")


def pipelined_outputs(
    model: PipelinedModel,
    micro_batches: list[DataProto],
    remove_padding: bool,
    sp_group: dist.ProcessGroup | None = None,
    loss: Callable[[int, ResponseOutputs], torch.Tensor] | None = None,
    replay: RouteReplay | None = None,
    balance: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    record_routes: list[torch.Tensor] | None = None,
) -> list[ResponseOutputs] | None:
    """``response_outputs`` of every micro-batch through a pipelined model's stages. With ``loss`` (training): loss(i,
    outputs) is micro-batch i's loss, which the schedule backwards; returns None. Without: forward only; returns the
    outputs on the rank holding the last stage, None elsewhere. ``replay``: ``response_outputs``' ``replay_routes``,
    each stage routing through its layers' columns of the batch's ``routed_experts``. ``balance``: a mixture's
    balancing loss from micro-batch i's routing statistics, added to its loss (``PipelinedModel.run``).
    ``record_routes`` (forward only): receives each micro-batch's routes as ``response_outputs``', on the rank holding
    the last stage (the stages carry them there). ``sp_group`` (Ulysses): each rank's stages run its slice of every
    micro-batch (packing.py ``sequence_slice``), and the outputs are those among the slice's, as
    ``response_outputs``' under Ulysses."""
    check_pipelined(remove_padding)
    packed = [packed_responses(micro) for micro in micro_batches]
    routes = None
    if replay is not None and all(ROUTED_EXPERTS in micro.batch.keys() for micro in micro_batches):
        routes = [micro.batch[ROUTED_EXPERTS][p.kept] for micro, (p, _) in zip(micro_batches, packed)]
    shards = [None] * len(packed)
    if sp_size(sp_group) > 1:  # which of the kept outputs this rank's slice computes
        _, start, width = sequence_slice([p for p, _ in packed], sp_group)
        real = [real_in_slice(p.input_ids.shape[1], start, width) for p, _ in packed]  # the slice's, not filler
        shards = [
            ResponseShard((keep >= start) & (keep < start + width), sp_group, tokens)
            for (_, keep), tokens in zip(packed, real)
        ]

    def outputs(index: int, logits: torch.Tensor) -> ResponseOutputs:
        return ResponseOutputs(logits, packed[index][0].response_valid, shards[index])

    staged_loss = None if loss is None else (lambda index, logits: loss(index, outputs(index, logits)))
    record = record_routes is not None
    results = model.run(
        [p for p, _ in packed], [keep for _, keep in packed], staged_loss, routes, replay, balance, record, sp_group
    )
    if results is None:
        return None
    if record:
        results, recorded = zip(*results)
        for micro, (p, _), chosen in zip(micro_batches, packed, recorded):
            if sp_size(sp_group) > 1:  # every slice's, in the packed order, the padding cut
                chosen = all_gather_slices(chosen, sp_group)[: p.input_ids.shape[1]]
            record_routes.append(rows_of_tokens(chosen, p.token_position, micro.batch[ATTENTION_MASK]))
    return [outputs(i, logits) for i, logits in enumerate(results)]


@torch.no_grad()
def batched_log_probs(
    model: nn.Module,
    data: DataProto,
    micro_batch_size: int,
    temperature: float,
    with_entropy: bool,
    *,
    remove_padding: bool = False,
    max_token_len: int | None = None,
    sp_group: dist.ProcessGroup | None = None,
    replay_routes: RouteReplay | None = None,
    routes: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of a whole batch, micro-batch by micro-batch without grad (``_batched``); ``sp_group``:
    Ulysses over its ranks, which all hold ``data``; ``replay_routes``: through the batch's recorded experts;
    ``routes``: a list that receives the experts the forward routed each token to, (B, P+R, L, k)."""
    recorded = [] if routes is not None else None
    parts, groups = _batched(
        model,
        lambda micro, outputs: log_probs_of(outputs, micro, temperature, with_entropy),
        data,
        micro_batch_size,
        remove_padding,
        max_token_len,
        sp_group,
        replay_routes,
        recorded,
    )
    if routes is not None:
        routes.append(restore_order(recorded, groups))
    log_probs = restore_order([p[0] for p in parts], groups)
    entropy = restore_order([p[1] for p in parts], groups) if with_entropy else None
    return log_probs, entropy


@torch.no_grad()
def batched_values(
    model: nn.Module,
    data: DataProto,
    micro_batch_size: int,
    *,
    remove_padding: bool = False,
    max_token_len: int | None = None,
    sp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Values of a whole batch, (B, R); micro-batches and ``sp_group`` as in ``batched_log_probs``."""
    parts, groups = _batched(
        model,
        lambda micro, outputs: values_of(outputs),
        data,
        micro_batch_size,
        remove_padding,
        max_token_len,
        sp_group,
    )
    return restore_order(parts, groups)
