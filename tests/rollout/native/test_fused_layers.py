"""The fused decode ops (kernels/csrc/fused_decode.cpp, rollout/native/fused_layers.py): bit for bit the torch ops of
model.py's loop, op by op and through whole decode and extend steps of the dense families in bf16 and fp32."""

import pytest
import torch
import torch.nn.functional as F
from rollout_helpers import engine_config

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.native import NativeRollout, fused_layers, model, ragged_attention

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def ops():
    return ragged_attention.module()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inner", [(64, 1536), (5, 100), (1, 70), (3, 33)])  # widths with a scalar tail
def test_silu_mul_is_torch_s_bit_for_bit(ops, dtype, rows, inner):
    generator = torch.Generator().manual_seed(rows * inner)
    gate_up = (torch.randn(rows, 2 * inner, generator=generator) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(64, 576), (5, 896), (3, 100)])
def test_add_rms_norm_is_torch_s_bit_for_bit(ops, dtype, rows, hidden):
    generator = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=generator) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=generator).to(dtype)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    total, normed = ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, model.rms_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_attend_is_the_loop_s_ops_bit_for_bit(ops, dtype):
    """Rotary on q and k, k and v stored at each token's position of its slot, attention over positions
    0..position: against model.rotate, index writes and ragged_attention.decode_attention. Slots out of order,
    and two tokens of one slot (an extend's consecutive positions: the first must not see the second's key)."""
    generator = torch.Generator().manual_seed(3)
    q_heads, kv_heads, dim, slots_total, positions_total = 6, 2, 32, 5, 24
    slots = torch.tensor([3, 0, 4, 4])
    positions = torch.tensor([7, 0, 11, 12])
    tokens = len(slots)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    cos = torch.randn(positions_total, dim, generator=generator).to(dtype)
    sin = torch.randn(positions_total, dim, generator=generator).to(dtype)
    keys = torch.randn(slots_total, kv_heads, positions_total, dim, generator=generator).to(dtype)
    values = torch.randn(slots_total, kv_heads, positions_total, dim, generator=generator).to(dtype)
    lengths = positions + 1
    width, scale = int(lengths.max()), dim**-0.5

    fused_keys, fused_values = keys.clone(), values.clone()
    attn = ops.rope_store_attend(
        qkv, cos, sin, positions, fused_keys, fused_values, slots, lengths, width, scale, q_heads
    )

    q_size, kv_size = q_heads * dim, kv_heads * dim
    qk = model.rotate(
        qkv[:, : q_size + kv_size].view(tokens, q_heads + kv_heads, dim),
        cos[positions][:, None],
        sin[positions][:, None],
    )
    for token, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist())):
        keys[slot, :, position] = qk[token, q_heads:]
        values[slot, :, position] = qkv[token, q_size + kv_size :].view(kv_heads, dim)
    q = qk[:, :q_heads].reshape(tokens, kv_heads, q_heads // kv_heads, dim)
    expected = ragged_attention.decode_attention(q, keys, values, lengths, scale, slots, width)
    assert torch.equal(fused_keys, keys) and torch.equal(fused_values, values)
    assert torch.equal(attn, expected.reshape(tokens, q_size))


def test_a_position_outside_the_cache_is_refused(ops):
    cache = torch.zeros(2, 1, 8, 16)
    qkv, table = torch.zeros(1, 3 * 16), torch.zeros(8, 16)
    with pytest.raises(RuntimeError, match="every position must be within the cache"):
        ops.rope_store_attend(
            qkv, table, table, torch.tensor([8]), cache, cache.clone(), torch.tensor([0]), torch.tensor([8]), 8, 1.0, 1
        )


def _engine(name, dtype):
    hf_model = load_causal_lm(name, dtype=dtype).eval()
    return NativeRollout(hf_model, load_tokenizer(name), engine_config=engine_config()).engine


def _prefilled(engine, generator, histories):
    vocab = engine.weights.embed.shape[0]
    for slot, length in histories.items():
        tokens = torch.randint(0, vocab, (1, length), generator=generator)
        model.prefill(engine.weights, engine.rope, engine.cache, tokens, torch.tensor([length]), torch.tensor([slot]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])  # untied; tied with q/k/v biases
def test_decode_and_extend_steps_equal_the_unfused_loop(name, dtype, monkeypatch):
    engine = _engine(name, dtype)
    assert fused_layers.fits(engine.weights)
    engine.prepare(6, 64)
    generator = torch.Generator().manual_seed(4)
    _prefilled(engine, generator, {0: 3, 1: 17, 2: 9, 4: 30})
    vocab = engine.weights.embed.shape[0]
    ran = []
    layers = fused_layers.decode_layers
    monkeypatch.setattr(fused_layers, "decode_layers", lambda *a, **k: ran.append(1) or layers(*a, **k))

    def both(step):
        """step() through the fused layers and through model.py's loop, from the same cache."""
        before_k, before_v = engine.cache.k.clone(), engine.cache.v.clone()
        fused = step(), engine.cache.k.clone(), engine.cache.v.clone()
        engine.cache.k.copy_(before_k)
        engine.cache.v.copy_(before_v)
        with monkeypatch.context() as patch:
            patch.setattr(fused_layers, "fits", lambda weights: False)
            unfused = step(), engine.cache.k.clone(), engine.cache.v.clone()
        return fused, unfused

    weights, rope, cache = engine.weights, engine.rope, engine.cache
    tokens = torch.randint(0, vocab, (4,), generator=generator)
    slots, positions = torch.tensor([4, 0, 2, 1]), torch.tensor([30, 3, 9, 17])
    fused, unfused = both(lambda: model.decode(weights, rope, cache, tokens, positions, True, slots))
    assert ran and all(torch.equal(a, b) for a, b in zip(fused, unfused))

    ran.clear()  # a multi-turn extend: new turns packed through the same layers, one slot with no history
    tokens = torch.randint(0, vocab, (3, 6), generator=generator)
    lengths, starts, slots = torch.tensor([6, 1, 4]), torch.tensor([17, 0, 9]), torch.tensor([1, 3, 2])
    fused, unfused = both(lambda: model.extend(weights, rope, cache, tokens, lengths, starts, slots, 5, ragged=True))
    assert ran and all(torch.equal(a, b) for a, b in zip(fused, unfused))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_prefill_and_padded_extend_equal_the_unfused_mlp(name, dtype, ops, monkeypatch):
    """Prefill and the padded extend run each layer's residual add, post-attention norm and SiLU x up through the
    fused ops (the rest as model.py writes it): the same logits and cache as the torch ops."""
    engine = _engine(name, dtype)
    engine.prepare(6, 64)
    generator = torch.Generator().manual_seed(5)
    vocab = engine.weights.embed.shape[0]
    weights, rope, cache = engine.weights, engine.rope, engine.cache
    calls = []
    norm = ops.add_rms_norm
    monkeypatch.setattr(ops, "add_rms_norm", lambda *a: calls.append(1) or norm(*a))

    def both(step):
        before_k, before_v = cache.k.clone(), cache.v.clone()
        calls.clear()
        fused = step(), cache.k.clone(), cache.v.clone()
        assert len(calls) == engine.weights.spec.num_layers
        cache.k.copy_(before_k)
        cache.v.copy_(before_v)
        with monkeypatch.context() as patch:
            patch.setattr(fused_layers, "fits", lambda weights: False)
            unfused = step(), cache.k.clone(), cache.v.clone()
        return all(torch.equal(a, b) for a, b in zip(fused, unfused))

    tokens = torch.randint(0, vocab, (3, 12), generator=generator)
    lengths, slots = torch.tensor([12, 5, 9]), torch.tensor([0, 2, 1])
    assert both(lambda: model.prefill(weights, rope, cache, tokens, lengths, slots))
    tokens = torch.randint(0, vocab, (2, 7), generator=generator)
    lengths, starts, slots = torch.tensor([7, 3]), torch.tensor([12, 5]), torch.tensor([0, 2])
    assert both(lambda: model.extend(weights, rope, cache, tokens, lengths, starts, slots, 5))  # padded rows


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-olmoe"])
def test_experts_and_q_k_norms_take_the_unfused_loop(name):
    assert not fused_layers.fits(_engine(name, torch.float32).weights)
