"""The ragged decode kernel: attention over each slot's real length, against float64 math and the whole-row path."""

import pytest
import torch
from rollout_helpers import engine_config

from hybridflow.rollout.native import NativeRollout, model, ragged_attention


def reference(q, keys, values, lengths, scale):
    """Attention of q (B, Hkv, G, D) over positions 0..lengths[b]-1 of slot b, in float64."""
    out = []
    for b, n in enumerate(lengths.tolist()):
        scores = torch.einsum("hgd,htd->hgt", q[b].double(), keys[b, :, :n].double()) * scale
        out.append(torch.einsum("hgt,htd->hgd", scores.softmax(-1), values[b, :, :n].double()))
    return torch.stack(out)


def test_the_kernel_builds_here():
    assert ragged_attention.available(), ragged_attention.unavailable_reason()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "groups, dim", [(3, 64), (1, 64), (2, 32), (2, 24)]
)  # (2, .): sizes read at run time; 24: no AVX-512 path
def test_attention_over_each_slot_s_own_length(dtype, tolerance, groups, dim):
    generator = torch.Generator().manual_seed(groups * dim)
    slots, heads, positions = 9, 2, 40
    keys = torch.randn(slots, heads, positions, dim, generator=generator).to(dtype)
    values = torch.randn(slots, heads, positions, dim, generator=generator).to(dtype)
    keys[:, :, 30:] = 1e4  # what lies beyond a slot's length (and in the slots past B) must not be read
    lengths = torch.tensor([1, 5, 30, 17, 29, 2, 12])
    q = torch.randn(len(lengths), heads, groups, dim, generator=generator).to(dtype)
    out = ragged_attention.decode_attention(q, keys, values, lengths, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, keys, values, lengths, dim**-0.5)
    assert (out.double() - expected).abs().max() < tolerance
    # a one-position slot attends to that position only: its value row, exactly (up to the dtype)
    assert torch.allclose(out[0].double(), values[0, :, :1].double().expand(heads, groups, dim), atol=tolerance)
    # sequences in any slots, in any order (multi-turn requests keep theirs)
    slots = torch.tensor([8, 0, 3, 7, 1, 6, 2])
    moved = ragged_attention.decode_attention(q, keys, values, lengths, dim**-0.5, slots)
    expected = reference(q, keys[slots], values[slots], lengths, dim**-0.5)
    assert (moved.double() - expected).abs().max() < tolerance


def test_bad_lengths_are_refused():
    keys = torch.zeros(4, 1, 8, 16)
    q = torch.zeros(2, 1, 1, 16)
    with pytest.raises(RuntimeError, match="every length must be in 1..width"):
        ragged_attention.decode_attention(q, keys, keys, torch.tensor([0, 3]), 1.0)
    with pytest.raises(RuntimeError, match="width exceeds the cache"):
        ragged_attention.decode_attention(q, keys, keys, torch.tensor([9, 3]), 1.0)
    with pytest.raises(RuntimeError, match="every slot must be one of the cache's"):
        ragged_attention.decode_attention(q, keys, keys, torch.tensor([2, 3]), 1.0, torch.tensor([0, 4]))


def test_a_decode_step_equals_the_whole_row_path(tiny):
    """fp32: the same logits and the same cache whether decode reads real lengths or masks whole rows."""
    _, hf_model, tokenizer = tiny
    engine = NativeRollout(hf_model, tokenizer, engine_config=engine_config()).engine
    engine.prepare(6, 48)
    generator = torch.Generator().manual_seed(0)
    vocab = hf_model.config.vocab_size
    lengths = [3, 17, 9, 30]
    for slot, length in enumerate(lengths):  # each slot's prompt, prefilled on its own
        tokens = torch.randint(0, vocab, (1, length), generator=generator)
        model.prefill(engine.weights, engine.rope, engine.cache, tokens, torch.tensor([length]), torch.tensor([slot]))
    tokens = torch.randint(0, vocab, (len(lengths),), generator=generator)
    positions = torch.tensor(lengths)
    cache_k = engine.cache.k.clone()
    whole = model.decode(engine.weights, engine.rope, engine.cache, tokens, positions)
    after_whole = engine.cache.k.clone()
    engine.cache.k.copy_(cache_k)
    ragged = model.decode(engine.weights, engine.rope, engine.cache, tokens, positions, ragged=True)
    torch.testing.assert_close(ragged, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine.cache.k, after_whole, rtol=1e-5, atol=1e-5)  # later layers: rounding


def test_an_extend_over_packed_real_tokens_equals_the_padded_one(tiny):
    """fp32: turns of different lengths appended to histories of different lengths (a slot with none) give the
    same logits and the same cached keys/values through the kernel as through padded rows and masked SDPA."""
    _, hf_model, tokenizer = tiny
    engine = NativeRollout(hf_model, tokenizer, engine_config=engine_config()).engine
    engine.prepare(6, 64)
    generator = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    histories = {0: 0, 3: 21, 1: 7, 4: 12}  # slot: cached positions
    for slot, length in histories.items():
        if length:
            tokens = torch.randint(0, vocab, (1, length), generator=generator)
            model.prefill(
                engine.weights, engine.rope, engine.cache, tokens, torch.tensor([length]), torch.tensor([slot])
            )
    slots = torch.tensor(list(histories))
    starts = torch.tensor(list(histories.values()))
    lengths = torch.tensor([9, 1, 14, 5])
    tokens = torch.randint(0, vocab, (4, 14), generator=generator)
    before_k, before_v = engine.cache.k.clone(), engine.cache.v.clone()
    padded = model.extend(engine.weights, engine.rope, engine.cache, tokens, lengths, starts, slots, scratch_slot=5)
    padded_k, padded_v = engine.cache.k.clone(), engine.cache.v.clone()
    engine.cache.k.copy_(before_k)
    engine.cache.v.copy_(before_v)
    packed = model.extend(engine.weights, engine.rope, engine.cache, tokens, lengths, starts, slots, 5, ragged=True)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    for slot, start, length in zip(slots.tolist(), starts.tolist(), lengths.tolist()):
        end = start + length
        torch.testing.assert_close(engine.cache.k[:, slot, :, :end], padded_k[:, slot, :, :end], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(engine.cache.v[:, slot, :, :end], padded_v[:, slot, :, :end], rtol=1e-5, atol=1e-5)
        assert engine.cache.k[:, slot, :, end:].abs().sum() == 0  # nothing written past a row's real tokens
    assert torch.equal(engine.cache.k[:, 5], before_k[:, 5])  # the packed form writes no pads to the scratch slot


def test_extend_packs_only_short_spans(tiny, monkeypatch):
    """Up to RAGGED_EXTEND_MAX_TOKENS new tokens per row go packed through the kernel; a longer span takes the
    padded rows and SDPA, whose blocked products are faster there."""
    _, hf_model, tokenizer = tiny
    engine = NativeRollout(hf_model, tokenizer, engine_config=engine_config()).engine
    limit = model.RAGGED_EXTEND_MAX_TOKENS
    engine.prepare(3, limit + 8)
    calls = []
    padded = model._extend_padded
    monkeypatch.setattr(model, "_extend_padded", lambda *a, **k: calls.append(1) or padded(*a, **k))
    for span, padded_calls in ((limit, 0), (limit + 1, 1)):
        calls.clear()
        tokens = torch.randint(0, hf_model.config.vocab_size, (2, span), generator=torch.Generator().manual_seed(2))
        lengths, starts, slots = torch.tensor([span, 3]), torch.tensor([0, 5]), torch.tensor([0, 1])
        model.extend(engine.weights, engine.rope, engine.cache, tokens, lengths, starts, slots, 2, ragged=True)
        assert len(calls) == padded_calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups, dim", [(3, 64), (7, 128), (2, 24)])  # compile-time shapes; read at run time
@pytest.mark.parametrize("positions", [1, 17, 130])  # widths below, past and well past a vector of 16
def test_the_one_call_attention_is_the_two_passes_bit_for_bit(dtype, groups, dim, positions):
    """The kernel's one call (scores, torch's softmax steps, values in one task) against its two passes with
    torch.softmax between them, rounded as decode_attention rounds: the same bits."""
    kernels = ragged_attention.module()
    generator = torch.Generator().manual_seed(groups * dim + positions)
    keys = (torch.randn(11, 2, positions, dim, generator=generator) * 2).to(dtype)
    values = torch.randn(11, 2, positions, dim, generator=generator).to(dtype)
    q = (torch.randn(9, 2, groups, dim, generator=generator) * 2).to(dtype)
    lengths = torch.randint(1, positions + 1, (9,), generator=generator)
    slots = torch.randperm(11, generator=generator)[:9]
    width, scale = int(lengths.max()), dim**-0.5
    scores = kernels.scores(q, keys, lengths, slots, width, scale)
    two_passes = kernels.values(torch.softmax(scores.to(dtype), dim=-1).float(), values, lengths, slots)
    assert torch.equal(kernels.attend(q, keys, values, lengths, slots, width, scale), two_passes)
