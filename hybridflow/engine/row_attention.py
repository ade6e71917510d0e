"""Attention of the packed rows as batched matmuls (engine/packing.py ``packed_sdpa_attention`` runs it for short
rows): the moves between the packed tokens and the rows, the grouped causal attention over rows, and the split of the
rows into prompt rows and response queries (``PromptSplit``) that computes only the outputs that are used, for short
rows as matmuls and for long ones through SDPA (``sdpa_split_attention``). Each move and the softmax run through the
C++ kernels where they fit (kernels/elementwise.py ``fits``), the same bits as torch's ops."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.kernels import elementwise, packed_rows


@dataclass(frozen=True)
class PromptSplit:
    """The queries of the same rows in two parts, so that attention computes only outputs that are used: each prompt
    once, as a row of its own over its own tokens (p prompt rows, the longest of Lp tokens), and each row's response
    tokens (Q at most) over the row's keys, its first query at key position ``query_offset``. Rows sharing a prompt
    would otherwise each compute its queries, and every row the full (L, L) scores of its longest neighbour."""

    prompt_index: torch.Tensor  # (p, Lp) packed position of each prompt's tokens; 0 after a prompt's end
    query_index: torch.Tensor  # (b, Q) packed position of each row's response tokens; 0 after its last
    query_offset: torch.Tensor  # (b,) the row's slot (key position) of its first response token
    real: torch.Tensor  # (N,) each packed token's flat slot in the prompt rows (p * Lp) then the queries (b * Q)

    def scores(self, keys: int) -> int:
        """Score entries per head: the prompt rows' and the queries' over rows of ``keys`` slots."""
        prompts, lp = self.prompt_index.shape
        rows, queries = self.query_index.shape
        return prompts * lp * lp + rows * queries * keys

    def flash_scores(self, keys: int) -> float:
        """``scores`` as SDPA's flash kernel computes them: a causal row only up to each query (half its square), the
        queries with their explicit mask over every key of their row."""
        prompts, lp = self.prompt_index.shape
        rows, queries = self.query_index.shape
        return prompts * lp * lp / 2 + rows * queries * keys


def _fused_gather(x: torch.Tensor, index: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """x (1, h, N, d) -> (r, h, l, d) at the packed positions index (r, l), one pass (with ``transpose``, laid out as
    the scores' matmul takes the keys)."""
    out = packed_rows.rows(x, index.flatten(), index.shape[0], transpose)
    return out.transpose(-1, -2) if transpose else out


def torch_gather(x: torch.Tensor, index: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``_fused_gather`` with torch's ops."""
    return x[0].index_select(1, index.flatten()).unflatten(1, index.shape).transpose(0, 1)


def _torch_tokens(y: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``packed_rows.tokens`` with torch's ops: y (r, h, l, d) -> (1, N, h, d), token i from flat slot real[i]."""
    return y.transpose(1, 2).flatten(0, 1).index_select(0, real).unsqueeze(0)


def _fused_tokens(y: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """y (r, h, l, d) -> (1, N, h, d), token i from flat slot real[i], one pass (``packed_rows.tokens``)."""
    return packed_rows.tokens(y, real)


# a response mask's entries per SDPA call (rows x queries x keys): SDPA may widen a boolean mask to the queries' dtype
SDPA_MASK_ENTRIES = 1 << 24

fused_moves = (_fused_gather, _fused_tokens)
torch_moves = (torch_gather, _torch_tokens)


def split_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: PromptSplit,
    scale: float,
    moves: tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """``packed_sdpa_attention``'s short rows over ``split``: each prompt's tokens over its own, then each row's
    response tokens over the row's keys and values k, v (b, Hkv, L, d) gathered from key and value; (1, N, H, d).
    Every token's output is the one the full rows give it (the same query, keys and mask), up to the order its sums
    round in."""
    gather, tokens = moves
    prompts = split.prompt_index
    prompt_out = grouped_causal_attention(
        gather(query, prompts), gather(key, prompts, transpose=True), gather(value, prompts), scale
    )  # (p, H, Lp, d)
    response_out = grouped_causal_attention(gather(query, split.query_index), k, v, scale, split.query_offset)
    return tokens(_joined(prompt_out, response_out), split.real)


def sdpa_split_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, index: torch.Tensor, split: PromptSplit, scale: float
) -> torch.Tensor:
    """``packed_sdpa_attention``'s long rows (index (b, L): each row's packed positions) over ``split`` through SDPA:
    each prompt causal over its own tokens, then each row's response tokens over the row's keys with a mask of their
    causal rows (query j of a row sees its keys up to query_offset + j); (1, N, H, d). Rows sharing a prompt would
    otherwise each compute its queries again: with n samples of a long prompt, most of the attention's work."""
    gqa = key.shape[1] != query.shape[1]
    prompts = split.prompt_index
    prompt_out = torch.nn.functional.scaled_dot_product_attention(
        torch_gather(query, prompts),
        torch_gather(key, prompts),
        torch_gather(value, prompts),
        is_causal=True,
        scale=scale,
        enable_gqa=gqa,
    )  # (p, H, Lp, d)
    q, k, v = torch_gather(query, split.query_index), torch_gather(key, index), torch_gather(value, index)
    rows, _, queries, _ = q.shape
    keys = torch.arange(index.shape[1], device=index.device)
    last_key = split.query_offset[:, None] + torch.arange(queries, device=index.device)  # (b, Q)
    step = max(1, SDPA_MASK_ENTRIES // (queries * len(keys)))
    parts = []
    for start in range(0, rows, step):  # the rows in groups whose mask stays small
        mask = keys <= last_key[start : start + step, :, None]  # (rows of the group, Q, L)
        parts.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[start : start + step],
                k[start : start + step],
                v[start : start + step],
                attn_mask=mask[:, None],
                scale=scale,
                enable_gqa=gqa,
            )
        )
    response_out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (b, H, Q, d)
    return _torch_tokens(_joined(prompt_out, response_out), split.real)


def _joined(prompt_out: torch.Tensor, response_out: torch.Tensor) -> torch.Tensor:
    """The prompt rows' outputs (p, H, Lp, d) and the queries' (b, H, Q, d) as (1, H, p * Lp + b * Q, d): one row of
    every output slot, in the order ``PromptSplit.real`` numbers them."""
    both = torch.cat([prompt_out.transpose(0, 1).flatten(1, 2), response_out.transpose(0, 1).flatten(1, 2)], dim=1)
    return both.unsqueeze(0)


def grouped_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention, q (b, H, L, d) and k/v (b, Hkv, L, d) -> (b, H, L, d), as matmuls.

    The G = H/Hkv query heads of a kv head (consecutive, as transformers groups them) are folded
    into the query axis, so keys and values are used as they are, not repeated. ``offsets`` (b,): q (b, H, Q, d) are
    Q queries of each row from key position offsets[row] on (each sees the keys up to its own position) -> (b, H, Q, d).
    """
    b, h, queries, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    groups = h // hkv
    scores = torch.matmul(q.reshape(b, hkv, groups * queries, d), k.transpose(-1, -2))  # (b, Hkv, G*Q, L)
    bias = causal_bias(length, q.device)
    if scores.dtype == v.dtype and elementwise.fits(scores):  # the same bits in one pass each way
        probs = elementwise.causal_softmax(scores, bias, scale, offsets, queries)
    else:
        scores = scores.view(b, hkv, groups, queries, length)
        if offsets is not None:  # each query's row of the causal bias
            positions = (offsets[:, None] + torch.arange(queries, device=q.device)).clamp(max=length - 1)
            bias = bias[positions][:, None, None]  # (b, 1, 1, Q, L)
        # scale, causal mask and float32 in one pass: bias + scale * scores with a bias of -inf above the diagonal and
        # 0 elsewhere gives the bits of scores.float() * scale masked to -inf (x + 0 == x; the multiply-add rounds once)
        scores = torch.add(bias, scores, alpha=scale)
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, groups * queries, length)
    return torch.matmul(probs, v).view(b, h, queries, d)


@functools.lru_cache(maxsize=16)
def causal_bias(length: int, device: torch.device) -> torch.Tensor:
    """(L, L) float32: -inf where the key comes after the query, 0 elsewhere. Kept for the next calls (every layer of a
    pass asks for its length's; only read, never written): making it took three passes over L x L a layer. Made outside
    inference mode, so that a no-grad pass's bias serves a training pass too."""
    with torch.inference_mode(False):
        return torch.zeros(length, length, device=device).masked_fill_(
            torch.ones(length, length, dtype=torch.bool, device=device).triu_(1), float("-inf")
        )
