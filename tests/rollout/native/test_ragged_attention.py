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
