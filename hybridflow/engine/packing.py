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

Each row's attention computes only the outputs that are used (``row_attention.PromptSplit``): every prompt once, as
a row of its own, and then each row's response tokens as queries over the row's keys, the causal mask starting at the
row's first response slot. The full rows would compute a shared prompt's queries in every row that holds it (only one
row's outputs are kept) and every row's L x L scores at the longest row's L. The same outputs, up to the order the
sums round in (a key's gradient gathers the prompt row's and the rows' queries apart). Measured (bench/update_parts.py's
batch, smollm2, 32 samples = 8 prompts x 4, the same update alternated in one process): 2.78 s -> 2.64 s. Long rows
(SDPA, below) take it too where it computes fewer scores (``PromptSplit.flash_scores``): bench/long_prompts.py, 8
prompts of up to 1,024 tokens x 4 samples of up to 256: the update 1.35x, the old log-probs 1.31x.

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

import inspect
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridflow.engine.row_attention import (
    PromptSplit,
    fused_moves,
    grouped_causal_attention,
    sdpa_split_attention,
    split_attention,
    torch_gather,
    torch_moves,
)
from hybridflow.engine.sequence_parallel import (
    gather_heads_scatter_sequence,
    gather_sequence_scatter_heads,
    heads_for_sp,
)
from hybridflow.kernels import elementwise
from hybridflow.lengths import prompt_leaders

PACKED_ATTENTION = "packed_sdpa"


@dataclass(frozen=True)
class Segments:
    """Where the rows lie in the packed sequence; b rows, the longest of L tokens, N tokens in all."""

    index: torch.Tensor  # (b, L) packed position of slot (row, t); 0 on the slots after a row's end
    real: torch.Tensor  # (N,) for each packed token, the flat slot in (b * L) whose output it takes
    split: PromptSplit | None = None  # the same rows' queries as prompt rows and response queries (None: not made)


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
    index = torch.where(in_row, position.gather(1, columns), 0)
    segments = Segments(
        index=index,
        # each packed token's output: the slot of the row that holds it
        real=(rows.unsqueeze(1) * len(slots) + slot_of)[keep],
        split=_prompt_split(index, mask, keep, slot_of, leader == rows, prompt_length),
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


def _prompt_split(
    index: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor,
    slot_of: torch.Tensor,
    leads: torch.Tensor,
    prompt_length: int,
) -> PromptSplit:
    """``pack``'s rows as prompt rows and response queries (``PromptSplit``): index (b, L) its segments' index, mask and
    keep (b, P+R), slot_of each real token's slot in its row, leads (b,) the rows that hold their prompt's tokens."""
    prompt_lengths = mask[:, :prompt_length].sum(1)  # (b,) real tokens are left-aligned in the row: the prompt's first
    response_lengths = mask[:, prompt_length:].sum(1)
    leaders = leads.nonzero()[:, 0]
    lp = max(int(prompt_lengths[leaders].max()) if len(leaders) else 0, 1)
    queries = max(int(response_lengths.max()) if len(mask) else 0, 1)
    width = index.shape[1]

    def part(starts: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, size: int) -> torch.Tensor:
        columns = starts[:, None] + torch.arange(size, device=index.device)
        taken = index[rows].gather(1, columns.clamp(max=width - 1))
        return torch.where(columns < (starts + counts)[:, None], taken, 0)

    all_rows = torch.arange(len(mask), device=index.device)
    prompt_index = part(torch.zeros_like(leaders), prompt_lengths[leaders], leaders, lp)
    query_index = part(prompt_lengths, response_lengths, all_rows, queries)
    ordinal = leads.long().cumsum(0) - 1  # a leader's prompt row
    in_prompt = torch.arange(mask.shape[1], device=index.device) < prompt_length
    flat = torch.where(
        in_prompt,
        ordinal[:, None] * lp + slot_of,
        len(leaders) * lp + all_rows[:, None] * queries + slot_of - prompt_lengths[:, None],
    )
    return PromptSplit(prompt_index, query_index, prompt_lengths, flat[keep])


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
    split = packed.segments.split
    return PackedBatch(
        input_ids=torch.cat([ids, ids.new_zeros(1, extra)], dim=1),
        position_ids=torch.cat([packed.position_ids, torch.arange(extra, device=ids.device).unsqueeze(0)], dim=1),
        segments=Segments(index=new_index, real=real, split=None if split is None else _with_filler(split, filler)),
        response_index=packed.response_index,
        response_valid=packed.response_valid,
        kept=packed.kept,
        token_position=packed.token_position,
    )


def _with_filler(split: PromptSplit, filler: torch.Tensor) -> PromptSplit:
    """``split`` with the filler tokens (packed positions ``filler``, ``pad_packed``) as one more prompt row."""
    prompts, lp = split.prompt_index.shape
    width = max(lp, len(filler))
    prompt_index = split.prompt_index.new_zeros(prompts + 1, width)
    prompt_index[:prompts, :lp] = split.prompt_index
    prompt_index[prompts, : len(filler)] = filler
    real = split.real
    in_prompts = real < prompts * lp
    real = torch.where(in_prompts, (real // lp) * width + real % lp, real - prompts * lp + (prompts + 1) * width)
    real = torch.cat([real, prompts * width + torch.arange(len(filler), device=real.device)])
    # the filler row is also a row of the keys: it asks no queries there
    query_index = torch.cat([split.query_index, split.query_index.new_zeros(1, split.query_index.shape[1])])
    query_offset = torch.cat([split.query_offset, split.query_offset.new_zeros(1)])
    return PromptSplit(prompt_index, query_index, query_offset, real)


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
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    split = packed_segments.split  # each prompt's queries once, where it computes fewer scores
    short = (
        longest <= MATMUL_ATTENTION_MAX_LENGTH
        and rows * query.shape[1] * longest * longest <= MATMUL_ATTENTION_MAX_SCORES
    )
    if short and dropout == 0.0:
        # the moves into rows and back: one pass each way through the C++ kernels where they fit (the same bits)
        moves = fused_moves if elementwise.fits(query, key, value) else torch_moves
        gather, tokens = moves
        index = packed_segments.index
        k, v = gather(key, index, transpose=True), gather(value, index)
        if split is not None and split.scores(longest) < rows * longest * longest:
            return split_attention(query, key, value, k, v, split, scale, moves), None
        return tokens(grouped_causal_attention(gather(query, index), k, v, scale), packed_segments.real), None
    if dropout == 0.0 and split is not None and split.flash_scores(longest) < rows * longest * longest / 2:
        return sdpa_split_attention(query, key, value, packed_segments.index, split, scale), None
    q, k, v = (torch_gather(x, packed_segments.index) for x in (query, key, value))  # (b, h, L, d)
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
