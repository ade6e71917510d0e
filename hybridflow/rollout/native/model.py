"""The decoder forward on the packed weights: RMSNorm, rotary embeddings, GQA attention, SwiGLU or routed experts.

Two entry points, both pure functions of (weights, rotary tables, cache, token tensors):
`prefill` runs whole prompts and stores their keys/values, `decode` runs one new token per
running sequence against the cache. Neither knows about requests or scheduling.

Numerics follow transformers' modules op for op (norms in fp32, rotary tables
computed in fp32 then cast, residual stream in the weights' dtype), so fp32 results match
HF to rounding and bf16 results match HF bf16 closely.

GQA without repeating keys: the G = Hq/Hkv query heads that share a kv head are folded into
the query axis, so attention runs as (B*Hkv, G*T, D) queries against (B*Hkv, L, D) keys: one
`scaled_dot_product_attention` call in prefill, two batched matmuls around a softmax in decode.

Under tensor parallelism (parallel.py) the same code runs on a rank's heads and MLP slice (its
`weights.spec` is the local one); the two row-parallel products are summed over the group. Under pipeline
stages (stages.py) it runs on a rank's layers: what enters them comes from the stage before, what leaves goes
to the next, and the last stage's residual stream reaches every rank before the final norm and the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.rollout.native import fused_layers, ragged_attention
from hybridflow.rollout.native.kv_cache import KVCache
from hybridflow.rollout.native.spec import ModelSpec
from hybridflow.rollout.native.weights import Experts, LayerWeights, Weights


class RotaryTables:
    """cos and sin of every position up to `max_len`: two (max_len, D) tensors in the compute dtype."""

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device | str):
        d = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (T, D/2)
        angles = torch.cat([freqs, freqs], dim=-1)  # (T, D)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)
        self.max_len = max_len


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., H) -> (..., H): normalised in fp32, rounded to x's dtype, then scaled (as HF does)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (..., D) with cos/sin broadcastable to it (halves layout, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _qkv(weights: Weights, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """(..., H) -> (..., Q + 2K): queries | keys | values of every head, before rotary; q and k RMS-normalised where
    the family does (spec.qk_norm), then all three clamped where it clips (spec.clip_qkv), as transformers orders it.
    Every site that computes q/k (prefill, decode, extend) goes through here."""
    spec = weights.spec
    qkv = layer.qkv(rms_norm(x, layer.input_norm, spec.rms_norm_eps))
    if layer.q_norm is not None and spec.qk_norm == "full" and weights.tp.size > 1:
        qkv = _split_full_norms(weights, layer, qkv)
    elif layer.q_norm is not None:
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        qkv = torch.cat([_group_norm(q, layer.q_norm, spec), _group_norm(k, layer.k_norm, spec), v], dim=-1)
    if spec.clip_qkv is not None:
        qkv = qkv.clamp(-spec.clip_qkv, spec.clip_qkv)
    return qkv


def _split_full_norms(weights: Weights, layer: LayerWeights, qkv: torch.Tensor) -> torch.Tensor:
    """``_qkv``'s norms over all of q's and all of k's heads (OLMoE) when tensor parallelism splits the heads: each
    rank's sums of squares, one all-reduce for both, then each rank scales its own heads (as ``rms_norm``: fp32,
    rounded to the input's dtype, then the weight's slice)."""
    spec, size = weights.spec, weights.tp.size
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q32, k32 = q.float(), k.float()
    sums = weights.tp.all_reduce(torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1))
    means = sums / torch.tensor([q.shape[-1] * size, k.shape[-1] * size], dtype=sums.dtype, device=sums.device)
    scale = torch.rsqrt(means + spec.rms_norm_eps)
    q = layer.q_norm * (q32 * scale[..., :1]).to(q.dtype)
    k = layer.k_norm * (k32 * scale[..., 1:]).to(k.dtype)
    return torch.cat([q, k, v], dim=-1)


def _group_norm(x: torch.Tensor, weight: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """(..., N) -> (..., N): RMSNorm over each group of weight.numel() values: each head's (a (D,) weight, Qwen3-MoE) or
    all of them at once (an (N,) weight, OLMoE)."""
    groups = x.unflatten(-1, (-1, weight.shape[0]))
    return rms_norm(groups, weight, spec.rms_norm_eps).flatten(-2)


def _output_and_mlp(weights: Weights, layer: LayerWeights, x, attn, record=None, fused: bool = False) -> torch.Tensor:
    """Residual stream after the attention output projection and the SwiGLU MLP (or mixture of experts): (..., H).
    ``record``: a mixture of experts appends its tokens' chosen experts (``routed_mlp``). ``fused``:
    ``fused_layers.fits(weights)``, asked once per forward by the caller."""
    if fused and layer.experts is None:  # the same numbers, the add, norm and SiLU fused
        return fused_layers.output_and_mlp(weights, layer, x, attn)
    x = x + weights.tp.all_reduce(layer.o(attn))
    normed = rms_norm(x, layer.post_norm, weights.spec.rms_norm_eps)
    if layer.experts is not None:
        return x + weights.tp.all_reduce(routed_mlp(layer.experts, normed, record))
    gate, up = layer.gate_up(normed).chunk(2, dim=-1)
    return x + weights.tp.all_reduce(layer.down(F.silu(gate) * up))


def routed_mlp(experts: Experts, x: torch.Tensor, record: list | None = None) -> torch.Tensor:
    """(..., H) -> (..., H): each token through its top-k experts (softmax over the router's logits in fp32; the
    chosen weights renormalised to sum to 1 if ``experts.renormalize``, as Mixtral always does and Qwen3-MoE / OLMoE
    by ``norm_topk_prob``; rounded to x's dtype if ``experts.round_weights``, as the latter two do), computed expert
    by expert on the rows routed to it (one matmul pair per expert, not per token) and summed per token in expert
    order, as transformers does. Under tensor parallelism only this rank's experts run: the caller sums the ranks'
    outputs. ``record``: the tokens' chosen experts (N, k) are appended to it (routing replay)."""
    shape, flat = x.shape, x.reshape(-1, x.shape[-1])
    weights, order, counts = route_tokens(experts, flat, record)
    first, held = experts.first, experts.gate_up.shape[0]  # this rank's experts (all of them on one rank)
    start = sum(counts[:first])
    mine = order[start : start + sum(counts[first : first + held])]  # the pairs routed to them, by expert
    tokens = mine // experts.top_k
    rows = flat[tokens]
    outputs, start = [], 0
    for expert, count in enumerate(counts[first : first + held]):
        if count:
            routed = rows[start : start + count]
            gate_up = experts.matrices.gate_up[expert](routed)
            if experts.gate_up_adapter is not None:
                experts.gate_up_adapter.add_to(gate_up, routed, expert)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
            output = experts.matrices.down[expert](hidden)
            if experts.down_adapter is not None:
                experts.down_adapter.add_to(output, hidden, expert)
            outputs.append(output)
        start += count
    combined = torch.zeros_like(flat)
    if outputs:  # under tensor parallelism a rank's experts may get no token
        scaled = (torch.cat(outputs) * weights.reshape(-1)[mine, None]).to(flat.dtype)
        combined.index_add_(0, tokens, scaled)
    return combined.reshape(shape)


def route_tokens(
    experts: Experts, flat: torch.Tensor, record: list | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``routed_mlp``'s routing of (N, H) tokens: each token's top-k weights (N, k), the (token, choice) pairs ordered
    by expert (N * k,), and each expert's count of pairs. ``record``: the chosen experts (N, k) are appended."""
    probs = torch.softmax(F.linear(flat, experts.router).float(), dim=-1)
    weights, chosen = probs.topk(experts.top_k, dim=-1)
    if record is not None:
        record.append(chosen)
    if experts.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if experts.round_weights:
        weights = weights.to(flat.dtype)
    pairs = chosen.reshape(-1)
    order = torch.argsort(pairs, stable=True)  # (token, choice) pairs by expert
    return weights, order, torch.bincount(pairs, minlength=experts.router.shape[0]).tolist()


def _logits(weights: Weights, x: torch.Tensor) -> torch.Tensor:
    """(N, H) -> (N, V), in the weights' dtype."""
    return weights.lm_head(rms_norm(x, weights.norm, weights.spec.rms_norm_eps))


def prefill(
    weights: Weights,
    rope: RotaryTables,
    cache: KVCache,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    start: int = 0,
    record: list | None = None,
) -> torch.Tensor:
    """Run right-padded prompt tokens at positions start.. and store their keys/values in `slots`.

    tokens (Bp, T) right-padded, lengths (Bp,) real tokens per row, slots (Bp,). With start > 0
    the slots already hold the keys/values of positions 0..start-1 (a prefix shared by all
    rows), and the new tokens attend to them. Returns the logits after each row's last real
    token: (Bp, V). Pad positions are computed but never attended to by real ones
    (causal), and their cache entries are overwritten before anything reads them. ``record``: each MoE layer
    appends its tokens' experts, (Bp * T, k) in row-major order.
    """
    spec = weights.spec
    b, t = tokens.shape
    hkv, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    cos, sin = rope.cos[start : start + t], rope.sin[start : start + t]  # (T, D)
    query_pos = torch.arange(start, start + t, device=tokens.device).repeat(g)  # (G*T,): q rows are (g, t)
    visible = torch.arange(start + t, device=tokens.device)[None, :] <= query_pos[:, None]  # (G*T, start+T)
    mark = None if record is None else len(record)
    fused = fused_layers.fits(weights)
    x = weights.stages.received(weights.embed[tokens])  # (Bp, T, H)
    for i, layer in enumerate(weights.layers):
        q, k, v = _qkv(weights, layer, x).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = rotate(q.view(b, t, hkv, g, d), cos[:, None, None], sin[:, None, None])
        k = rotate(k.view(b, t, hkv, d), cos[:, None], sin[:, None]).transpose(1, 2)  # (Bp, Hkv, T, D)
        v = v.view(b, t, hkv, d).transpose(1, 2)
        cache.write_prompt(i, slots, k, v, start)
        if start:
            k, v = cache.k[i, slots, :, : start + t], cache.v[i, slots, :, : start + t]  # (Bp, Hkv, start+T, D)
        q = q.permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)  # (Bp, Hkv, G*T, D)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        attn = attn.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, spec.q_size)
        x = _output_and_mlp(weights, layer, x, attn, record, fused)
    x = weights.stages.passed_on(x)
    _whole_routes(weights, record, mark)
    last = x[torch.arange(b, device=x.device), lengths - 1]  # (Bp, H)
    return _logits(weights, weights.stages.from_last(last))


def _whole_routes(weights: Weights, record: list | None, mark: int | None) -> None:
    """Under pipeline stages (stages.py), the experts this forward's MoE layers chose (``record[mark:]``, this
    rank's layers) become every stage's, in layer order: a collective of the stages, once each has sent its hidden
    states on (before, the first stage would wait for the second, which waits for its input)."""
    if record is not None and weights.stages.size > 1 and weights.spec.num_experts:
        record[mark:] = weights.stages.whole_routes(record[mark:])


def decode(
    weights: Weights,
    rope: RotaryTables,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    ragged: bool = False,
    slots: torch.Tensor | None = None,
    record: list | None = None,
) -> torch.Tensor:
    """One new token for each of the sequences in slots 0..B-1 (``ragged``: in cache slots ``slots``, any order).

    tokens (B,) the latest token of each sequence, positions (B,) its position (= the number
    of tokens already cached). Stores its keys/values and returns next-token logits (B, V).
    Attention is written out as two batched matmuls around a softmax, over the slots' whole
    (contiguous) cache rows with the unused positions masked: with one query per sequence
    this is several times faster on CPU than the fused kernel, and than slicing the rows
    (a slice would be copied). ``ragged``: the kernel of ragged_attention.py instead, which
    reads positions 0..positions[b] of each slot only (float32 scores and softmax; for slots
    much longer than the sequences in them, as in multi-turn rollout). ``record``: each MoE layer appends the
    tokens' experts, (B, k).
    """
    return _logits(weights, _decode_hidden(weights, rope, cache, tokens, positions, ragged, slots, record))


def _decode_hidden(
    weights: Weights,
    rope: RotaryTables,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    ragged: bool,
    slots: torch.Tensor | None,
    record: list | None = None,
) -> torch.Tensor:
    """`decode` up to the final norm: the residual stream after the last layer, (B, H). Each layer stores every
    token's keys/values before any attends, so in ragged mode several tokens may share a slot (consecutive
    positions of one sequence): each attends to its own position and those before it (`extend`)."""
    spec = weights.spec
    b = tokens.shape[0]
    hq, hkv, g, d = spec.num_heads, spec.num_kv_heads, spec.group_size, spec.head_dim
    t = cache.max_len
    if slots is not None and not ragged:
        raise ValueError("decode over chosen slots needs ragged=True (whole rows are read as slots 0..B-1)")
    scale = d**-0.5
    fused = fused_layers.fits(weights)
    x = weights.stages.received(weights.embed[tokens])  # (B, H)
    if ragged:  # what every layer's attention reads, computed once for the step
        lengths = (positions + 1).to(torch.int64)
        width = int(lengths.max())
        if slots is None:
            slots = torch.arange(b, device=tokens.device)
        if fused:  # the same numbers, the work between matmuls fused (rotary, the cache writes and attention inside)
            normed = rms_norm(x, weights.layers[0].input_norm, spec.rms_norm_eps)
            x = fused_layers.decode_layers(
                weights, rope.cos, rope.sin, cache, x, normed, positions.long(), slots, lengths, width, scale
            )
            return weights.stages.from_last(weights.stages.passed_on(x))
    else:
        hidden = torch.arange(t, device=tokens.device)[None, :] > positions[:, None]  # (B, T)
        bias = torch.zeros(b, 1, t, dtype=weights.embed.dtype, device=tokens.device)
        bias = bias.masked_fill_(hidden[:, None], float("-inf")).repeat_interleave(hkv, dim=0)  # (B*Hkv, 1, T)
    cos, sin = rope.cos[positions][:, None], rope.sin[positions][:, None]  # (B, 1, D)
    index = cache.decode_index(positions, slots)
    mark = None if record is None else len(record)
    for i, layer in enumerate(weights.layers):
        qkv = _qkv(weights, layer, x)
        qk = rotate(qkv[:, : spec.q_size + spec.kv_size].view(b, hq + hkv, d), cos, sin)  # (B, Hq+Hkv, D)
        cache.write_token(i, index, qk[:, hq:], qkv[:, spec.q_size + spec.kv_size :].view(b, hkv, d))
        if ragged:
            q = qk[:, :hq].reshape(b, hkv, g, d)
            attn = ragged_attention.decode_attention(
                q, cache.k[i], cache.v[i], lengths, scale, slots, width
            )  # (B,Hkv,G,D)
        else:
            keys, values = cache.rows(i, b)  # (B*Hkv, T, D)
            q = qk[:, :hq].reshape(b * hkv, g, d)
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)  # (B*Hkv, G, T)
            attn = torch.bmm(scores.softmax(dim=-1), values)  # (B*Hkv, G, D)
        x = _output_and_mlp(weights, layer, x, attn.reshape(b, spec.q_size), record, fused)
    x = weights.stages.passed_on(x)
    _whole_routes(weights, record, mark)
    return weights.stages.from_last(x)


# Up to this many new tokens per row, `extend` runs packed through the ragged kernel; above, padded rows and SDPA.
# The kernel computes each query's scores on its own, which pays when a row's new tokens are few against its
# cached context; SDPA's blocked products pay for long spans. One extend of 64 rows, smollm2 bf16, 2 threads
# (01:10 UTC, idle): 20 new tokens after 150 cached, 1.26x faster packed (1.70x with lengths varying by
# row); 60 after 150, 1.21x (1.72x); 100 after 300, 0.77x (1.07x); 400 after none, 0.90x (1.18x).
RAGGED_EXTEND_MAX_TOKENS = 64


def extend(
    weights: Weights,
    rope: RotaryTables,
    cache: KVCache,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    scratch_slot: int,
    ragged: bool = False,
    record: list | None = None,
) -> torch.Tensor:
    """Append right-padded tokens to sequences that each already hold ``starts[b]`` cached positions.

    The multi-turn form of `prefill`: row b's tokens go to positions starts[b].. of slot slots[b] and
    attend to that slot's cached keys/values before them (a conversation's earlier turns), so a new
    turn computes only its own tokens. tokens (Bp, T), lengths (Bp,) real tokens per row (>= 1),
    starts (Bp,), slots (Bp,). The pad positions' keys/values go to ``scratch_slot`` (a slot no
    sequence holds), never over a real one. Returns the logits after each row's last real token (Bp, V).

    ``ragged``: when no row appends more than RAGGED_EXTEND_MAX_TOKENS tokens (a tool's answer, the next
    user message), the real tokens only, packed into one sequence of tokens each with its own slot and
    position, through the ragged decode kernel (each reads its slot's positions 0..its own): no pad
    computed, no cached keys gathered into padded rows, no mask (float32 scores and softmax, as decode).

    ``record``: each MoE layer appends the chosen experts of the real tokens (N, k), rows in order, each row's
    tokens in order (routing replay).
    """
    if ragged and int(lengths.max()) <= RAGGED_EXTEND_MAX_TOKENS:
        real = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]  # (Bp, T)
        rows, offsets = real.nonzero(as_tuple=True)  # row-major: each row's tokens in order, rows in order
        hidden = _decode_hidden(weights, rope, cache, tokens[real], starts[rows] + offsets, True, slots[rows], record)
        return _logits(weights, hidden[lengths.cumsum(0) - 1])  # each row's last token
    return _extend_padded(weights, rope, cache, tokens, lengths, starts, slots, scratch_slot, record)


def _extend_padded(
    weights: Weights,
    rope: RotaryTables,
    cache: KVCache,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    scratch_slot: int,
    record: list | None,
) -> torch.Tensor:
    """``extend`` over right-padded rows: each row's keys and values gathered from its slot, with a mask."""
    spec = weights.spec
    b, t = tokens.shape
    hkv, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    device = tokens.device
    offsets = torch.arange(t, device=device)
    real = offsets[None, :] < lengths[:, None]  # (Bp, T)
    positions = starts[:, None] + offsets[None, :]  # (Bp, T)
    write_slot = torch.where(real, slots[:, None], scratch_slot)  # (Bp, T)
    write_pos = torch.where(real, positions, offsets[None, :])  # pads: distinct positions of the scratch slot
    rope_pos = positions.clamp(max=rope.max_len - 1)
    cos, sin = rope.cos[rope_pos], rope.sin[rope_pos]  # (Bp, T, D)
    context = int((starts + lengths).max())  # keys every row may need: (Bp, Hkv, context, D)
    query_pos = positions[:, None, :].expand(b, g, t).reshape(b, g * t)  # (Bp, G*T): q rows are (g, t)
    visible = torch.arange(context, device=device)[None, None, :] <= query_pos[:, :, None]  # (Bp, G*T, ctx)
    heads = torch.arange(hkv, device=device)
    padded = None if record is None else []  # every (row, offset)'s experts; the real tokens' kept
    fused = fused_layers.fits(weights)
    x = weights.stages.received(weights.embed[tokens])  # (Bp, T, H)
    for i, layer in enumerate(weights.layers):
        q, k, v = _qkv(weights, layer, x).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = rotate(q.view(b, t, hkv, g, d), cos[:, :, None, None], sin[:, :, None, None])
        k = rotate(k.view(b, t, hkv, d), cos[:, :, None], sin[:, :, None])  # (Bp, T, Hkv, D)
        index = (write_slot[:, :, None], heads[None, None, :], write_pos[:, :, None])
        cache.k[i].index_put_(index, k)
        cache.v[i].index_put_(index, v.view(b, t, hkv, d))
        keys, values = cache.k[i, slots, :, :context], cache.v[i, slots, :, :context]  # (Bp, Hkv, ctx, D)
        q = q.permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)  # (Bp, Hkv, G*T, D)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None])
        attn = attn.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, spec.q_size)
        x = _output_and_mlp(weights, layer, x, attn, padded, fused)
    x = weights.stages.passed_on(x)
    if record is not None:
        _whole_routes(weights, padded, 0)
        record += [chosen.view(b, t, -1)[real] for chosen in padded]
    last = x[torch.arange(b, device=device), lengths - 1]  # (Bp, H)
    return _logits(weights, weights.stages.from_last(last))
