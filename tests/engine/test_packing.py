"""Padding removal: the packed passes equal the padded ones (fp32), values and gradients."""

import dataclasses

import pytest
import torch

from hybridflow.batch_keys import METRICS, REF_LOG_PROB
from hybridflow.engine import packing, row_attention
from hybridflow.engine.forward import batched_log_probs, batched_values, response_log_probs, response_values
from hybridflow.engine.packing import pack, packed_forward, pad_packed
from hybridflow.engine.reference import FrozenPolicyEngine
from hybridflow.engine.row_attention import causal_bias, grouped_causal_attention
from hybridflow.lengths import computed_lengths
from hybridflow.models.loading import enable_activation_checkpointing, load_causal_lm, load_critic
from hybridflow.protocol import DataProto
from hybridflow.trainer.setup.config import default_config

PROMPT, RESPONSE = 6, 5


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal up to fp32 rounding, relative to the tensor's largest entry (summation order differs)."""
    assert (actual - expected).abs().max() <= rtol * expected.abs().max() + 1e-7


def make_batch(prompt_lengths: list[int], response_lengths: list[int], vocab: int = 500, seed: int = 0) -> DataProto:
    """Rows in the rollout layout: left-padded prompts, right-padded responses, positions from 0."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.tensor(prompt_lengths).unsqueeze(1)
    response = torch.tensor(response_lengths).unsqueeze(1)
    attention_mask = torch.cat(
        [torch.arange(PROMPT) >= PROMPT - prompt, torch.arange(RESPONSE) < response], dim=1
    ).long()
    input_ids = torch.randint(1, vocab, attention_mask.shape, generator=generator) * attention_mask
    response_mask = attention_mask[:, PROMPT:]
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "responses": input_ids[:, PROMPT:],
            "response_mask": response_mask,
            "advantages": torch.randn(response_mask.shape, generator=generator) * response_mask,
        }
    )


def test_pack_layout_by_hand():
    batch = make_batch([2, 3], [1, 0])
    packed = pack(batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"], RESPONSE)
    ids = batch.batch["input_ids"]
    # row 0: prompt columns 4, 5 and response column 6; row 1: prompt columns 3, 4, 5, no response
    assert packed.input_ids.tolist() == [[ids[0, 4], ids[0, 5], ids[0, 6], ids[1, 3], ids[1, 4], ids[1, 5]]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert packed.segments.index.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert packed.segments.real.tolist() == [0, 1, 2, 3, 4, 5]
    # response token 0 of row 0 is predicted by packed token 1 (its last prompt token)
    assert packed.response_index[0, 0] == 1 and packed.response_index[1, 0] == 5
    assert packed.response_valid.tolist() == [[True, False, False, False, False], [False] * 5]


def make_grouped_batch(
    prompts: tuple[int, ...] = (4, 2, 6), responses: tuple[int, ...] = (5, 1, 3, 0, 2, 5, 4, 4, 1)
) -> DataProto:
    """GRPO-shaped: 3 prompts x 3 samples, the rows of a group shuffled apart, responses unequal (one empty)."""
    batch = make_batch([length for length in prompts for _ in range(3)], list(responses), seed=3)
    ids = batch.batch["input_ids"]
    for first in (0, 3, 6):
        ids[first + 1 : first + 3, :PROMPT] = ids[first, :PROMPT]
    batch.batch["responses"] = ids[:, PROMPT:]
    return batch[torch.tensor([0, 3, 6, 1, 4, 7, 2, 5, 8])]


@pytest.fixture(scope="module", params=["distinct-prompts", "grouped-prompts"])
def batch(request) -> DataProto:
    if request.param == "grouped-prompts":
        return make_grouped_batch()
    # unequal prompts and responses, an empty response, a full row
    return make_batch([6, 2, 4, 1, 5, 3], [5, 0, 3, 1, 2, 5])


def test_shared_prompt_layout_by_hand():
    batch = make_batch([2, 2, 1], [2, 1, 1])
    ids = batch.batch["input_ids"]
    ids[1, :PROMPT] = ids[0, :PROMPT]  # rows 0 and 1: one prompt (columns 4, 5), two samples
    packed = pack(ids, batch.batch["attention_mask"], batch.batch["position_ids"], RESPONSE)
    # the prompt once, row 0's response (columns 6, 7), row 1's response (column 6), then row 2
    assert packed.input_ids.tolist() == [[ids[0, 4], ids[0, 5], ids[0, 6], ids[0, 7], ids[1, 6], ids[2, 5], ids[2, 6]]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1]]
    assert packed.segments.index.tolist() == [[0, 1, 2, 3], [0, 1, 4, 0], [5, 6, 0, 0]]  # row 1 sees the shared prompt
    assert packed.segments.real.tolist() == [0, 1, 2, 3, 4 + 2, 8, 9]  # row 1's response is its slot 2
    assert packed.response_index[:, 0].tolist() == [1, 1, 5]  # both samples' first token follow the shared prompt
    assert computed_lengths(batch.batch["attention_mask"], ids, RESPONSE) == [4, 1, 2]
    # the split: the prompts once each (rows 0 and 2 hold theirs), then every row's response tokens as queries
    split = packed.segments.split
    assert split.prompt_index.tolist() == [[0, 1], [5, 0]]
    assert split.query_index.tolist() == [[2, 3], [4, 0], [6, 0]]
    assert split.query_offset.tolist() == [2, 2, 1]  # each row's first response slot
    assert split.real.tolist() == [0, 1, 4, 5, 6, 2, 8]  # 4 prompt slots (2 x 2), then 3 rows of 2 queries
    unshared = pack(ids, batch.batch["attention_mask"], batch.batch["position_ids"], RESPONSE, share_prompts=False)
    assert unshared.input_ids.shape[1] == 9
    assert unshared.segments.split.prompt_index.shape == (3, 2)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3-moe", "tiny-olmoe"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
def test_packed_log_probs_entropy_and_gradient_equal_padded(batch, name, checkpointing, attention, monkeypatch):
    if attention == "sdpa":  # rows too long for the matmul attention take SDPA's kernel
        monkeypatch.setattr(packing, "MATMUL_ATTENTION_MAX_SCORES", 0)
    torch.manual_seed(0)
    model = load_causal_lm(name, dtype=torch.float32)
    if checkpointing:  # backward recomputes the layers: they must see the packing again
        enable_activation_checkpointing(model)
    model.train()
    mask = batch.batch["response_mask"].bool()
    results = {}
    for remove_padding in (False, True):
        model.zero_grad()
        log_probs, entropy = response_log_probs(model, batch, 0.7, with_entropy=True, remove_padding=remove_padding)
        loss = -(batch.batch["advantages"] * log_probs)[mask].sum() / mask.sum() - 0.1 * entropy[mask].mean()
        loss.backward()
        results[remove_padding] = (log_probs, entropy, [p.grad.clone() for p in model.parameters()])
    (padded_lp, padded_ent, padded_grads), (packed_lp, packed_ent, packed_grads) = results[False], results[True]
    assert torch.allclose(packed_lp[mask], padded_lp[mask], atol=1e-5)
    assert torch.allclose(packed_ent[mask], padded_ent[mask], atol=1e-5)
    assert (packed_lp[~mask] == 0).all()
    for packed_grad, padded_grad in zip(packed_grads, padded_grads):
        assert_close_to_scale(packed_grad, padded_grad)
    assert max(g.abs().max() for g in padded_grads) > 0


def test_packed_values_and_gradient_equal_padded(batch):
    torch.manual_seed(0)
    critic = load_critic("tiny-llama", dtype=torch.float32)
    torch.nn.init.normal_(critic.score.weight, std=0.1)  # the head starts at 0: give values and gradients substance
    mask = batch.batch["response_mask"].bool()
    results = {}
    for remove_padding in (False, True):
        critic.zero_grad()
        values = response_values(critic, batch, remove_padding)
        (values[mask] ** 2).mean().backward()
        results[remove_padding] = (values, [p.grad.clone() for p in critic.parameters()])
    assert torch.allclose(results[True][0][mask], results[False][0][mask], atol=1e-5)
    for packed_grad, padded_grad in zip(results[True][1], results[False][1]):
        assert_close_to_scale(packed_grad, padded_grad)


def test_batched_passes_with_token_budget_keep_row_order(batch):
    model = load_causal_lm("tiny-llama", dtype=torch.float32).eval()
    critic = load_critic("tiny-llama", dtype=torch.float32).eval()
    torch.nn.init.normal_(critic.score.weight, std=0.1)
    mask = batch.batch["response_mask"].bool()
    padded_lp, padded_ent = batched_log_probs(model, batch, 4, 1.0, True)
    packed_lp, packed_ent = batched_log_probs(model, batch, 4, 1.0, True, remove_padding=True, max_token_len=12)
    assert torch.allclose(packed_lp[mask], padded_lp[mask], atol=1e-5)
    assert torch.allclose(packed_ent[mask], padded_ent[mask], atol=1e-5)
    padded_values = batched_values(critic, batch, 4)
    packed_values = batched_values(critic, batch, 4, remove_padding=True, max_token_len=12)
    assert torch.allclose(packed_values[mask], padded_values[mask], atol=1e-5)


def test_reference_engine_packed_with_token_budget_equals_padded(batch):
    model = load_causal_lm("tiny-llama", dtype=torch.float32)
    mask = batch.batch["response_mask"].bool()
    ref = default_config().actor_rollout_ref.ref
    padded_config = dataclasses.replace(ref, use_remove_padding=False)
    padded = FrozenPolicyEngine(model, padded_config).compute_log_prob(batch, 0.5).batch[REF_LOG_PROB]
    budget_config = dataclasses.replace(ref, use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=12)
    packed = FrozenPolicyEngine(model, budget_config).compute_log_prob(batch, 0.5)
    assert torch.allclose(packed.batch[REF_LOG_PROB][mask], padded[mask], atol=1e-5)
    assert packed.meta_info[METRICS]["perf/tflops_ref_log_prob"] > 0


def test_grouped_causal_attention_equals_sdpa_with_repeated_kv_heads():
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(3, 6, 7, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(3, 2, 7, 8, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    got = grouped_causal_attention(q, k, v, scale=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True, scale=0.3
    )
    torch.testing.assert_close(got, expected)
    weights = torch.randn(got.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)


def test_grouped_causal_attention_in_bf16_has_the_bits_of_a_float32_masked_softmax():
    """The scale, the causal mask and the cast to float32 run as one bias + scale * scores: the same bits as the
    plain steps (cast, multiply, fill the future with -inf), forward and backward, for any scale."""

    def stepwise(q, k, v, scale):
        b, h, length, d = q.shape
        groups = h // k.shape[1]
        scores = torch.matmul(q.reshape(b, k.shape[1], groups * length, d), k.transpose(-1, -2))
        scores = scores.view(b, k.shape[1], groups, length, length).float().mul(scale)
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, k.shape[1], groups * length, length)
        return torch.matmul(probs, v).view(b, h, length, d)

    generator = torch.Generator().manual_seed(5)
    for scale in (0.125, 0.3):
        tensors = [
            torch.randn(shape, generator=generator).bfloat16() for shape in [(4, 6, 19, 16), *[(4, 2, 19, 16)] * 2]
        ]
        weights = torch.randn(4, 6, 19, 16, generator=generator).bfloat16()
        results = []
        for attention in (grouped_causal_attention, stepwise):
            q, k, v = (tensor.clone().requires_grad_() for tensor in tensors)
            out = attention(q, k, v, scale)
            results.append((out, *torch.autograd.grad((out.float() * weights.float()).sum(), (q, k, v))))
        for got, expected in zip(*results):
            assert torch.equal(got, expected), scale


def test_filler_tokens_leave_every_real_output_unchanged():
    """``pad_packed``: a pipeline pads its micro-batches to one length; the filler is a row of its own, so the real
    tokens' outputs are the unpadded pass's."""
    torch.manual_seed(0)
    model = load_causal_lm("tiny-llama", dtype=torch.float32)
    ids = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 12, 13]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    packed = pack(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), response_length=2)
    with torch.no_grad():
        plain = packed_forward(model, packed)
        padded = packed_forward(model, pad_packed(packed, packed.input_ids.shape[1] + 7))
    assert padded.shape[1] == plain.shape[1] + 7
    torch.testing.assert_close(padded[:, : plain.shape[1]], plain, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cannot be padded"):
        pad_packed(packed, 3)


def test_the_causal_bias_is_made_once_per_length_and_serves_a_training_pass_after_an_inference_one():
    with torch.inference_mode():
        first = causal_bias(5, torch.device("cpu"))  # a no-grad pass asks first
    assert not first.is_inference() and causal_bias(5, torch.device("cpu")) is first
    expected = torch.tensor([[0.0 if key <= query else float("-inf") for key in range(5)] for query in range(5)])
    assert torch.equal(first, expected)
    scores = torch.randn(2, 5, 5, requires_grad=True)
    torch.add(first, scores, alpha=0.5).softmax(-1).sum().backward()  # a training pass reads it
    assert scores.grad is not None and torch.equal(first, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("filler", [0, 9], ids=["as-packed", "with-filler"])
@pytest.mark.parametrize(
    "path, mask_entries",
    [("split_attention", 0), ("sdpa_split_attention", 1 << 24), ("sdpa_split_attention", 20)],
    ids=["matmul", "sdpa", "sdpa-by-row"],
)
def test_split_attention_equals_the_full_rows(dtype, filler, path, mask_entries, monkeypatch):
    """The prompts once and the responses' queries alone give every token the output and gradients the full rows
    give it (the same queries, keys and mask), with and without ``pad_packed``'s filler row, on both paths (short rows
    as matmuls, long rows through SDPA: here every row made long): up to the rounding of sums taken in another order
    (a key's gradient gathers its prompt row's and its rows' queries apart)."""
    sdpa = path == "sdpa_split_attention"
    if sdpa:  # long prompts and short responses, where the split pays through SDPA; by-row: one row per SDPA call
        monkeypatch.setattr(packing, "MATMUL_ATTENTION_MAX_LENGTH", 0)
        monkeypatch.setattr(row_attention, "SDPA_MASK_ENTRIES", mask_entries)
    batch = make_grouped_batch((6, 6, 5), (2, 1, 2, 0, 1, 2, 2, 2, 1)) if sdpa else make_grouped_batch()
    packed = pack(batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"], RESPONSE)
    if filler:
        packed = pad_packed(packed, packed.input_ids.shape[1] + filler)
    n = packed.input_ids.shape[1]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 16, generator=generator).to(dtype) for h in (6, 2, 2))
    grad = torch.randn(1, n, 6, 16, generator=generator).to(dtype)
    rows, length = packed.segments.index.shape
    split = packed.segments.split
    assert split.flash_scores(length) < rows * length * length / 2 if sdpa else split.scores(length) < rows * length**2

    def attend(segments):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, _ = packing.packed_sdpa_attention(None, *inputs, None, scaling=0.25, packed_segments=segments)
        out.backward(grad)
        return out, [x.grad for x in inputs]

    called, sdpa_calls = [], []
    original, sdpa_function = getattr(packing, path), torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(packing, path, lambda *a: called.append(1) or original(*a))
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: sdpa_calls.append(1) or sdpa_function(*a, **k),
    )
    out, grads = attend(packed.segments)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_function)
    assert called, "the split layout was not taken"
    if sdpa:  # the prompts, then the queries in one call or (by row) one per row
        assert len(sdpa_calls) == 1 + (split.query_index.shape[0] if mask_entries < 1 << 24 else 1)
    full_out, full_grads = attend(dataclasses.replace(packed.segments, split=None))
    rtol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: an ulp of the largest entries
    assert_close_to_scale(out.float(), full_out.float(), rtol)
    for got, expected in zip(grads, full_grads):
        assert_close_to_scale(got.float(), expected.float(), rtol)


def test_long_rows_whose_prompts_are_short_keep_the_full_rows(monkeypatch):
    """Through SDPA the full rows cost half their squares (the flash kernel stops at each query) and the split's
    queries their whole rows: rows of a short prompt and a long response stay whole."""
    monkeypatch.setattr(packing, "MATMUL_ATTENTION_MAX_LENGTH", 0)
    prompt, response = 2, 12
    ids = torch.arange(1, 1 + 2 * (prompt + response)).view(2, prompt + response)
    mask = torch.ones_like(ids)
    packed = pack(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), response_length=response)
    rows, length = packed.segments.index.shape
    assert packed.segments.split.flash_scores(length) >= rows * length * length / 2
    monkeypatch.setattr(packing, "sdpa_split_attention", lambda *a: pytest.fail("the split was taken"))
    q, k, v = (torch.randn(1, 2, ids.numel(), 8) for _ in range(3))
    out, _ = packing.packed_sdpa_attention(None, q, k, v, None, packed_segments=packed.segments)
    assert out.shape == (1, ids.numel(), 2, 8)
