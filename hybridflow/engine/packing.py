"""Padding removal: a micro-batch's real tokens packed into one sequence, attention kept within rows.

The training batch keeps prompts left-padded and responses right-padded (B, P+R). ``pack`` takes
the real tokens (``attention_mask`` 1) of all rows, in order, as one sequence (1, N) with
N = sum of the row lengths and each row's own ``position_ids`` (0, 1, ... from its first real
token). The linear layers, i.e. nearly all of the compute, then see no pad token.

Attention must stay within each row (block-diagonal causal). transformers detects packed
``position_ids``, but with SDPA it then builds a dense (N, N) mask and attends over all N tokens,
and CPU PyTorch has no varlen kernel. So the model runs with its attention implementation set to
``packed_sdpa``: each layer gathers q, k, v back into (rows, longest row) with the real tokens
left-aligned and runs SDPA with ``is_causal=True``. Pad slots only follow a row's real tokens, so
causality alone keeps them out of every real token's context and no mask is needed. Attention is
about 1% of the FLOPs of these models at a few hundred tokens; the pad slots there cost little.
Without segments (an ordinary padded call) ``packed_sdpa`` is exactly transformers' ``sdpa``.

Measured (smollm2-135m, bf16, 2 CPU cores; 64 rows of 30-45 prompt + 0-32 response tokens, 38%
padding; log-prob pass in micro-batches of 16; best of 4): padded 2.86 s, transformers' packing
with the dense mask 3.16 s, rows trimmed to each sorted micro-batch's longest 2.60 s, this 2.14 s.

Rows with the same prompt (the n samples of one GRPO/RLOO group) share it: the prompt's tokens
are packed once, and each row's slots point at them (``Segments.index``), so its responses attend
to the prompt as before while the linear layers compute it once. In the backward the prompt's
keys and values collect the gradients of every row that attends to them, so values and
gradients equal the unshared computation. Measured (bench/train_passes.py, smollm2, 32 samples =
8 prompts x 4): update 2.58 s -> 1.57 s, old log-probs 0.80 s -> 0.50 s.

``response_index`` / ``response_valid`` say which packed outputs predict the response tokens;
``forward.py`` asks the model for the LM head's output at those positions only.

Within the rows, short rows (the common case in RL: a few hundred tokens) use attention written
out as two batched matmuls around a float32 softmax (on the CPU its scale, mask, softmax and rounding are one fused
kernel each way, the same bits: kernels/elementwise.py ``causal_softmax``): SDPA's CPU flash kernel is slow on such
shapes (bench/train_kernels.py: 32 rows x 77 tokens, 9 query / 3 kv heads, bf16, forward +
backward: flash 35 ms, SDPA's math backend 20 ms, this 7.5 ms per layer). Rows longer than
``MATMUL_ATTENTION_MAX_LENGTH``, or whose score matrices would be large, use SDPA: its flash kernel wins from a few
hundred tokens on (the same shapes, one layer: 8 rows x 256 tokens 12.5 ms against 17.3; 4 x 512 65.6 against 23.2;
1 x 2,048 326 against 60; 1 x 4,096 1,423 against 197), and it keeps no score matrix for the backward.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridflow.engine.sequence_parallel import (
    gather_heads_scatter_sequence,
    gather_sequence_scatter_heads,
    heads_for_sp,
)
from hybridflow.kernels import elementwise, packed_rows
from hybridflow.lengths import prompt_leaders

PACKED_ATTENTION = "packed_sdpa"


@dataclass(frozen=True)
class Segments:
    """Where the rows lie in the packed sequence; b rows, the longest of L tokens, N tokens in all."""

    index: torch.Tensor  # (b, L) packed position of slot (row, t); 0 on the slots after a row's end
    real: torch.Tensor  # (N,) for each packed token, the flat slot in (b * L) whose output it takes


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N) each row's own positions
    segments: Segments
    response_index: torch.Tensor  # (b, R) packed position of the output predicting each response token
    response_valid: torch.Tensor  # (b, R) bool: the response token is real
    kept: torch.Tensor  # (b, P+R) bool: the row tokens in the sequence (``values[kept]`` packs per-token values)
    token_position: torch.Tensor  # (b, P+R) packed position of each real token (a shared prompt's: its one copy)


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    share_prompts: bool = True,
) -> PackedBatch:
    """The real tokens of (b, P+R) rows as one (1, N) sequence; see the module docstring.

    ``share_prompts``: rows with the same prompt (the n samples of a GRPO group) put it in the
    sequence once; each row's attention still sees it as its own (``Segments.index`` points the
    row's prompt slots at the shared tokens), and gradients from every row reach it.
    """
    mask = attention_mask.bool()
    width = mask.shape[1]
    prompt_length = width - response_length
    if prompt_length < 1:
        raise ValueError(f"response length {response_length} leaves no prompt column in a width of {width}")
    rows = torch.arange(mask.shape[0], device=mask.device)
    leader = prompt_leaders(input_ids, attention_mask, prompt_length) if share_prompts and len(rows) else rows
    keep = mask.clone()
    keep[:, :prompt_length] &= (leader == rows).unsqueeze(1)  # a prompt's tokens once, in its first row
    position = keep.flatten().long().cumsum(0).view_as(keep) - 1  # packed position of each kept token
    position[:, :prompt_length] = position[leader, :prompt_length]  # shared prompts: the first row's tokens
    lengths = mask.sum(dim=1)  # (b,)
    slots = torch.arange(max(int(lengths.max()), 1) if len(lengths) else 1, device=mask.device)
    in_row = slots < lengths.unsqueeze(1)  # (b, L)
    # the row's real columns in order
    columns = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, : len(slots)]
    slot_of = mask.long().cumsum(1) - 1  # (b, P+R) slot of each real token within its row
    segments = Segments(
        index=torch.where(in_row, position.gather(1, columns), 0),
        # each packed token's output: the slot of the row that holds it
        real=(rows.unsqueeze(1) * len(slots) + slot_of)[keep],
    )
    # Response token t sits at column P+t and is predicted by the output at column P+t-1 (a real token).
    response_index = position[:, prompt_length - 1 : width - 1].clamp(min=0)
    return PackedBatch(
        input_ids=input_ids[keep].unsqueeze(0),
        position_ids=position_ids[keep].unsqueeze(0),
        segments=segments,
        response_index=response_index,
        response_valid=mask[:, prompt_length:],
        kept=keep,
        token_position=position,
    )


def pad_packed(packed: PackedBatch, length: int) -> PackedBatch:
    """``packed`` followed by filler tokens up to ``length``: a row of their own (token 0 at positions 0, 1, ...), so
    they attend to each other only and every real token's output is unchanged. A pipeline's micro-batches then all
    have one shape (engine/pipeline.py)."""
    total = packed.input_ids.shape[1]
    extra = length - total
    if extra < 0:
        raise ValueError(f"a packed batch of {total} tokens cannot be padded to {length}")
    if extra == 0:
        return packed
    index = packed.segments.index
    rows, longest = index.shape
    width = max(longest, extra)
    filler = torch.arange(total, length, device=index.device)
    new_index = torch.zeros(rows + 1, width, dtype=index.dtype, device=index.device)
    new_index[:rows, :longest] = index
    new_index[rows, :extra] = filler
    real = packed.segments.real
    real = torch.cat(
        [(real // longest) * width + real % longest, rows * width + torch.arange(extra, device=real.device)]
    )
    ids = packed.input_ids
    return PackedBatch(
        input_ids=torch.cat([ids, ids.new_zeros(1, extra)], dim=1),
        position_ids=torch.cat([packed.position_ids, torch.arange(extra, device=ids.device).unsqueeze(0)], dim=1),
        segments=Segments(index=new_index, real=real),
        response_index=packed.response_index,
        response_valid=packed.response_valid,
        kept=packed.kept,
        token_position=packed.token_position,
    )


_packed_calls = 0  # layers that ran packed attention: a model that bypasses AttentionInterface runs none


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_segments: Segments | None = None,
    sequence_shards: SequenceShards | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed row: query (1, H, N, d), key/value (1, Hkv, N, d) -> (1, N, H, d).
    ``sequence_shards``: this rank holds a slice of the packed tokens (Ulysses, ``ulysses_attention``)."""
    if sequence_shards is not None:
        return ulysses_attention(module, query, key, value, dropout, scaling, packed_segments, sequence_shards)
    if packed_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if attention_mask is not None or kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError(
            "packed attention supports plain causal attention only (no mask, sliding window or softcap)"
        )
    global _packed_calls
    _packed_calls += 1
    rows, longest = packed_segments.index.shape
    flat = packed_segments.index.flatten()

    def by_rows(x: torch.Tensor) -> torch.Tensor:  # (1, h, N, d) -> (b, h, L, d)
        return x[0].index_select(1, flat).unflatten(1, (rows, longest)).transpose(0, 1)

    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    short = (
        longest <= MATMUL_ATTENTION_MAX_LENGTH
        and rows * query.shape[1] * longest * longest <= MATMUL_ATTENTION_MAX_SCORES
    )
    if short and dropout == 0.0 and elementwise.fits(query, key, value):  # the same bits, one pass each way
        q = packed_rows.rows(query, flat, rows)
        k = packed_rows.rows(key, flat, rows, transpose=True).transpose(-1, -2)  # the layout the scores' matmul takes
        out = grouped_causal_attention(q, k, packed_rows.rows(value, flat, rows), scale)
        return packed_rows.tokens(out, packed_segments.real), None
    q, k, v = by_rows(query), by_rows(key), by_rows(value)
    if short and dropout == 0.0:
        out = grouped_causal_attention(q, k, v, scale)
    else:
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scale, is_causal=True, enable_gqa=key.shape[1] != query.shape[1]
        )  # (b, H, L, d)
    out = out.transpose(1, 2).flatten(0, 1).index_select(0, packed_segments.real)  # (N, H, d)
    return out.unsqueeze(0), None


@dataclass(frozen=True)
class SequenceShards:
    """A packed sequence over the ranks of an sp group: ``padded`` tokens (the ``total`` real ones, then padding to a
    multiple of sp), rank r holding the r-th ``padded / sp`` of them."""

    group: dist.ProcessGroup
    total: int
    padded: int

    def real_in(self, start: int, width: int) -> int:
        """Of the slice of ``width`` tokens from ``start``, those that are real (not padding to a multiple of sp)."""
        return real_in_slice(self.total, start, width)


def real_in_slice(real: int, start: int, width: int) -> int:
    """Of a sequence whose first ``real`` tokens are real (the rest padding), those in the ``width`` from ``start``."""
    return min(max(real - start, 0), width)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    segments: Segments,
    shards: SequenceShards,
) -> tuple[torch.Tensor, None]:
    """Packed attention on a slice of the tokens: query (1, H, N/sp, d), key/value (1, Hkv, N/sp, d) -> (1, N/sp, H,
    d). Heads are exchanged for tokens (engine/sequence_parallel.py), so each rank attends with H/sp heads over every
    token of every row (``segments`` describe the whole sequence), then the output is exchanged back."""
    group, sp = shards.group, dist.get_world_size(shards.group)

    def every_token(x: torch.Tensor) -> torch.Tensor:  # (1, heads, N/sp, d) -> (1, heads/sp, N, d), padding dropped
        return gather_sequence_scatter_heads(x, group, seq_dim=2, head_dim=1)[:, :, : shards.total]

    heads = query.shape[1]
    q, k, v = (every_token(x) for x in heads_for_sp(query, key, value, 1, sp))
    out, _ = packed_sdpa_attention(module, q, k, v, None, dropout, scaling, packed_segments=segments)  # (1, N, H/sp, d)
    out = nn.functional.pad(out, (0, 0, 0, 0, 0, shards.padded - shards.total))
    return gather_heads_scatter_sequence(out, group, seq_dim=1, head_dim=2)[:, :, :heads], None  # padding heads dropped


MATMUL_ATTENTION_MAX_SCORES = 1 << 26  # 64 M scores (256 MB in float32): above that, SDPA
MATMUL_ATTENTION_MAX_LENGTH = 320  # tokens in the longest row: above that, SDPA (the module docstring's timings)


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention, q (b, H, L, d) and k/v (b, Hkv, L, d) -> (b, H, L, d), as matmuls.

    The G = H/Hkv query heads of a kv head (consecutive, as transformers groups them) are folded
    into the query axis, so keys and values are used as they are, not repeated.
    """
    b, h, length, d = q.shape
    hkv = k.shape[1]
    groups = h // hkv
    scores = torch.matmul(q.reshape(b, hkv, groups * length, d), k.transpose(-1, -2))  # (b, Hkv, G*L, L)
    bias = causal_bias(length, q.device)
    if scores.dtype == v.dtype and elementwise.fits(scores):  # the same bits in one pass each way
        probs = elementwise.causal_softmax(scores, bias, scale)
    else:
        scores = scores.view(b, hkv, groups, length, length)
        # scale, causal mask and float32 in one pass: bias + scale * scores with a bias of -inf above the diagonal and
        # 0 elsewhere gives the bits of scores.float() * scale masked to -inf (x + 0 == x; the multiply-add rounds once)
        scores = torch.add(bias, scores, alpha=scale)
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, groups * length, length)
    return torch.matmul(probs, v).view(b, h, length, d)


@functools.lru_cache(maxsize=16)
def causal_bias(length: int, device: torch.device) -> torch.Tensor:
    """(L, L) float32: -inf where the key comes after the query, 0 elsewhere. Kept for the next calls (every layer of a
    pass asks for its length's; only read, never written): making it took three passes over L x L a layer. Made outside
    inference mode, so that a no-grad pass's bias serves a training pass too."""
    with torch.inference_mode(False):
        return torch.zeros(length, length, device=device).masked_fill_(
            torch.ones(length, length, dtype=torch.bool, device=device).triu_(1), float("-inf")
        )


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


def use_packed_attention(model: nn.Module) -> None:
    """Switch a model from ``sdpa`` to ``packed_sdpa`` (identical on padded calls). Idempotent."""
    current = model.config._attn_implementation
    if current not in ("sdpa", PACKED_ATTENTION):
        raise ValueError(f"use_remove_padding needs attn_implementation='sdpa', but the model uses {current!r}")
    model.config._attn_implementation = PACKED_ATTENTION


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep``: a peft model passes it on to the model it adapts."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def packed_forward(
    model: nn.Module,
    packed: PackedBatch,
    logits_to_keep: torch.Tensor | None = None,
    shards: SequenceShards | None = None,
) -> torch.Tensor:
    """The model's output (``.logits``) on a packed batch: (1, N, C), or (1, M, C) at the M
    packed positions ``logits_to_keep`` (for models whose forward takes it). ``shards``: this rank runs its slice of
    the tokens (``input_ids`` and ``position_ids`` of ``packed`` are the slice; ``logits_to_keep`` indexes it)."""
    use_packed_attention(model)
    calls = _packed_calls
    ids = packed.input_ids
    extra = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    if shards is not None:
        extra["sequence_shards"] = shards
    # An all-ones 2-D mask: transformers then skips both the packed-sequence detection (its dense
    # (N, N) mask) and any mask at all, and the layers get ``packed_segments`` instead.
    output = model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=packed.position_ids,
        packed_segments=packed.segments,
        use_cache=False,
        **extra,
    ).logits
    if _packed_calls == calls:
        raise RuntimeError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface; "
            "set use_remove_padding=false"
        )
    return output


def slice_packed(packed: PackedBatch, start: int, width: int) -> PackedBatch:
    """The ``width`` packed tokens from ``start`` (the segments still describe the whole sequence, which attention
    gathers under Ulysses)."""
    if width == packed.input_ids.shape[1]:
        return packed
    cut = slice(start, start + width)
    return replace(packed, input_ids=packed.input_ids[:, cut], position_ids=packed.position_ids[:, cut])


def empty_packed(like: PackedBatch) -> PackedBatch:
    """A micro-batch of no rows (``pad_packed`` fills it with filler tokens)."""
    ids = like.input_ids.new_zeros(1, 0)
    index = like.segments.index.new_zeros(0, 1)
    responses = like.response_valid.shape[1]
    return PackedBatch(
        input_ids=ids,
        position_ids=ids.clone(),
        segments=Segments(index=index, real=like.segments.real.new_zeros(0)),
        response_index=like.response_index.new_zeros(0, responses),
        response_valid=like.response_valid.new_zeros(0, responses),
        kept=like.kept.new_zeros(0, like.kept.shape[1]),
        token_position=like.token_position.new_zeros(0, like.kept.shape[1]),
    )


def sequence_slice(packed: list[PackedBatch], sp_group: dist.ProcessGroup | None) -> tuple[int, int, int]:
    """(length, start, width): a pipelined pass pads every micro-batch's packed tokens to ``length`` (a multiple of
    the ``sp_group``'s ranks), and under Ulysses this rank runs the ``width`` of them from ``start``."""
    sp = dist.get_world_size(sp_group) if sp_group is not None else 1
    length = -(-max(p.input_ids.shape[1] for p in packed) // sp) * sp
    width = length // sp
    return length, (dist.get_rank(sp_group) if sp > 1 else 0) * width, width
