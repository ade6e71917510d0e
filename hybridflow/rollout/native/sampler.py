"""Batched next-token choice on the tensor side: greedy, or temperature / top-k / top-p sampling.

Randomness is counter-based: the uniform number behind request r's t-th token is a hash of
(seed, r, t). Each request therefore has its own random stream, derived from `params.seed`
and its index in the batch, and the samples do not depend on which other requests shared
its decode steps, or in what order continuous batching ran them. The hash is the 32-bit
finaliser of MurmurHash3 applied in int64 arithmetic (exact on CPU and CUDA, no Python loop
over rows); a token is drawn by inverting the cumulative distribution at that number.

Log-probs follow `HFRollout`: the log-softmax of the temperature-scaled logits (before
top-k/top-p truncation), or of the raw logits for greedy decoding. The softmax over the
vocabulary is computed once per step and serves both the draw and the log-prob; an untruncated
draw on the CPU computes neither as a tensor: one C++ call (kernels/csrc/sampling.cpp) finds the
token and its log-prob from the logits (``fused_draw_fits``).
"""

from __future__ import annotations

import torch

from hybridflow.kernels import build as kernels
from hybridflow.rollout.sampling import SamplingParams

_MASK32 = 0xFFFFFFFF
_NUCLEUS_PROBE = 256  # top-p first looks for its nucleus among this many tokens, and sorts all only if needed


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix32 on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniforms(seed: int | torch.Tensor, requests: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) per row, a deterministic function of (seed, request, step): (B,) fp32. ``seed``: the
    call's, or one per row (B,) int64 (requests of several calls run together, each as it would alone)."""
    if isinstance(seed, torch.Tensor):
        low, high = seed.long() & _MASK32, (seed.long() >> 32) & _MASK32
    else:
        low = torch.tensor(seed & _MASK32, dtype=torch.int64, device=requests.device)
        high = torch.tensor((seed >> 32) & _MASK32, dtype=torch.int64, device=requests.device)
    key = _mix32(low ^ _mix32(high + 0x9E3779B9))
    h = _mix32(key ^ _mix32(requests.long() + 0x7F4A7C15))
    h = _mix32(h ^ _mix32((steps.long() * 0x2545F491 + 0x6C8E9CF5) & _MASK32))
    return ((h.double() + 0.5) / 2.0**32).float()


def _block_size(vocab: int) -> int:
    """The largest power of two up to 1024 dividing `vocab` (1 if it is odd)."""
    block = 1
    while block < 1024 and vocab % (2 * block) == 0:
        block *= 2
    return block


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token i of each row with cdf[i-1] < u * total <= cdf[i]: probs (B, V) fp32, u (B,) -> (B,) long.

    Two levels, so nothing scans the whole vocabulary sequentially: block sums (a vectorised
    reduction) locate the block, and only that block is scanned.
    """
    b, v = probs.shape
    block = _block_size(v)
    if block < 16:  # odd vocabulary sizes: one sequential scan
        cdf = probs.cumsum(-1)
        return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:]).clamp(max=v - 1)[:, 0]
    blocks = probs.view(b, v // block, block)
    cdf = blocks.sum(-1).cumsum(-1)  # (B, V/block)
    target = u[:, None] * cdf[:, -1:]  # (B, 1)
    j = torch.searchsorted(cdf, target).clamp(max=cdf.shape[1] - 1)  # the block
    before = torch.where(j > 0, cdf.gather(-1, (j - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(b, device=probs.device), j[:, 0]].cumsum(-1)  # (B, block)
    k = torch.searchsorted(inner, target - before)
    last = (inner < inner[:, -1:]).sum(-1, keepdim=True)  # the block's last token with mass (rounding guard)
    return (j * block + torch.minimum(k, last))[:, 0]


def _truncates(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p leaves out part of a vocabulary of ``vocab`` tokens."""
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _truncated(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The top-k / top-p candidates of (B, V) probs: (their probs (B, K), token ids (B, K)), or None.

    Top-k first, then top-p on the renormalised top-k distribution (as transformers' warpers
    do). Top-p probes the `_NUCLEUS_PROBE` most likely tokens first: when they hold at least
    top_p of the mass in every row, the nucleus lies among them (exact); else the whole
    vocabulary is sorted, which is slow on CPU (~100 ms for 64 x 49152 on 2 cores, against
    ~5 ms for the probe and ~1.4 ms for plain sampling).
    """
    vocab = probs.shape[-1]
    if not (0 < top_k < vocab) and top_p >= 1.0:
        return None
    if 0 < top_k < vocab:
        values, ids = probs.topk(top_k, dim=-1)
        values = values / values.sum(-1, keepdim=True)
    else:
        values, ids = probs.topk(min(_NUCLEUS_PROBE, vocab), dim=-1)
        if not bool((values.sum(-1) >= top_p).all()):
            values, ids = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        before = values.cumsum(dim=-1) - values  # mass of the strictly more likely tokens
        values = values.masked_fill(before >= top_p, 0.0)
    return values, ids


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    requests: torch.Tensor,
    steps: torch.Tensor,
    seeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the next token of each row.

    logits (B, V) (any float dtype); requests (B,) each row's request index; steps (B,) how
    many tokens that request has generated; seeds (B,): each row's seed instead of the call's.
    Returns tokens (B,) long and log-probs (B,) fp32.
    """
    if not params.do_sample:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        log_probs = logits.gather(-1, tokens[:, None])[:, 0] - logits.logsumexp(dim=-1)
        return tokens, log_probs
    u = uniforms(params.seed if seeds is None else seeds, requests, steps)
    if not _truncates(params, logits.shape[-1]) and fused_draw_fits(logits):
        tokens, log_probs = kernels.module().sample_rows(logits.contiguous(), u, float(params.temperature))
        return tokens, log_probs
    scaled = logits.float() / params.temperature if params.temperature != 1.0 else logits
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)  # (B, V)
    candidates = _truncated(probs, params.top_k, params.top_p)
    if candidates is None:
        tokens = _inverse_cdf(probs, u)
    else:
        values, ids = candidates
        cdf = values.cumsum(dim=-1)
        chosen = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:]).clamp(max=cdf.shape[-1] - 1)
        tokens = ids.gather(-1, chosen)[:, 0]
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()


def fused_draw_fits(logits: torch.Tensor) -> bool:
    """Whether an untruncated draw from ``logits`` runs in one C++ call (kernels/csrc/sampling.cpp): CPU (B, V) logits
    in float32 or bfloat16, the kernels built. Its tokens follow the same distribution at the same numbers ``u``,
    summed in another order than torch's softmax (a draw within a rounding error of a boundary between two tokens
    may take the other), and it writes no (B, V) probabilities: ``sample`` at 32 / 64 / 256 x 49,152 bf16 logits on
    2 cores, 1.0 / 1.9 / 8.7 ms -> 0.5 / 0.8 / 2.8 ms (docs/log/rollout.md §46)."""
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and kernels.available()
    )
