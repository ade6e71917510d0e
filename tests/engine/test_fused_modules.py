"""engine/fused_modules.py: a model's RMSNorms, SiLU MLPs and rotary embedding through the fused kernels give
transformers' numbers bit for bit, through whole forward and backward passes of the tiny families the engine trains,
packed as the update packs its rows; modules that compute otherwise keep their own forward."""

import sys

import pytest
import torch
from torch import nn

from hybridflow.engine.fused_modules import fuse_elementwise
from hybridflow.engine.packing import pack, packed_forward
from hybridflow.kernels import build, elementwise, packed_rows
from hybridflow.models import load_causal_lm

PROMPT, RESPONSE = 8, 6


def _rows(generator: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four rows as the update sees them (two sharing a prompt): prompts left-padded, responses right-padded."""
    prompts = torch.tensor([5, 5, 8, 3])[:, None]
    responses = torch.tensor([6, 2, 4, 1])[:, None]
    columns = torch.arange(PROMPT + RESPONSE)
    mask = ((columns >= PROMPT - prompts) & (columns < PROMPT + responses)).long()
    ids = torch.randint(3, vocab, mask.shape, generator=generator)
    ids[1, :PROMPT] = ids[0, :PROMPT]
    ids = ids * mask
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def _forward_backward(model: nn.Module, ids, mask, positions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = packed_forward(model, pack(ids, mask, positions, RESPONSE))
    weights = torch.linspace(-1, 1, logits.numel()).view_as(logits)
    (logits.float() * weights).sum().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3-moe"])
def test_fused_model_is_transformers_bit_for_bit(name, dtype, monkeypatch):
    """With its norms, MLPs, rotary embedding, the packed attention's softmax and its moves into rows and back fused,
    against the same model on torch's ops alone."""
    assert build.available(), build.unavailable_reason()
    generator = torch.Generator().manual_seed(0)
    plain = load_causal_lm(name, dtype=dtype).train()
    fused = load_causal_lm(name, dtype=dtype).train()
    fused.load_state_dict(plain.state_dict())
    layers = plain.config.num_hidden_layers
    count = fuse_elementwise(fused)
    assert count >= 2 * layers + 1  # at least two norms a layer and the final one (and q/k norms, dense MLPs)
    assert fuse_elementwise(fused) == count  # idempotent
    rows = _rows(generator, plain.config.vocab_size)

    with monkeypatch.context() as torch_ops_alone:  # the packed attention's kernels too (engine/packing.py)
        torch_ops_alone.setattr(elementwise, "fits", lambda *tensors: False)
        expected_logits, expected_grads = _forward_backward(plain, *rows)
    calls = []  # the fused run must run every kernel, not fall back to torch's ops unseen
    kernels = [(elementwise, n) for n in ("rms_norm", "silu_mul", "rotary", "causal_softmax")]
    for module, fn in kernels + [(packed_rows, "rows"), (packed_rows, "tokens")]:
        original = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _f=original, _n=fn, **k: calls.append(_n) or _f(*a, **k))
    logits, grads = _forward_backward(fused, *rows)
    assert {"rms_norm", "rotary", "causal_softmax", "rows", "tokens"} <= set(calls)
    assert "silu_mul" in calls or name == "tiny-qwen3-moe"  # its MLPs are experts (engine/moe.py), not Llama MLPs
    assert torch.equal(logits, expected_logits)
    assert grads.keys() == expected_grads.keys()
    for key, grad in expected_grads.items():
        assert torch.equal(grads[key], grad), key


def test_fused_forwards_run_the_kernels_and_step_aside_for_other_inputs(monkeypatch):
    """The fused forwards call the kernels on CPU float tensors, and transformers' forward on other dtypes."""
    model = load_causal_lm("tiny-llama", dtype=torch.float32)
    fuse_elementwise(model)
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    calls = []
    for fn in ("rms_norm", "silu_mul"):
        original = getattr(elementwise, fn)
        monkeypatch.setattr(elementwise, fn, lambda *a, _f=original, _n=fn: calls.append(_n) or _f(*a))
    hidden = torch.randn(2, 3, model.config.hidden_size)
    norm(hidden), mlp(hidden)
    assert calls == ["rms_norm", "silu_mul"]
    calls.clear()
    with torch.no_grad():
        expected = type(norm).forward(norm.double(), hidden.double())
        assert torch.equal(norm(hidden.double()), expected)  # float64: transformers' own forward
        mlp.double()(hidden.double())
    assert calls == []


def test_the_family_s_rotary_is_fused_by_name_and_steps_aside_for_other_inputs(monkeypatch):
    """The modeling module's ``apply_rotary_pos_emb`` gets the fused function once; it calls the kernel on CPU float
    tensors of the attention's shapes and transformers' function otherwise (float64, cos with a gradient)."""
    model = load_causal_lm("tiny-qwen2", dtype=torch.float32)
    fuse_elementwise(model)
    namespace = sys.modules[type(model.model.layers[0].self_attn).__module__]
    fused = namespace.apply_rotary_pos_emb
    unfused = fused.unfused
    fuse_elementwise(model)
    assert namespace.apply_rotary_pos_emb is fused  # idempotent: not wrapped twice
    calls = []
    monkeypatch.setattr(elementwise, "rotary", lambda *a, _f=elementwise.rotary: calls.append(1) or _f(*a))
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    for args in [(q, k, cos, sin), (q.double(), k.double(), cos.double(), sin.double())]:
        assert all(map(torch.equal, fused(*args), unfused(*args)))
    assert len(calls) == 2  # q and k of the float32 call
    fused(q, k, cos.requires_grad_(), sin)
    assert len(calls) == 2


def test_other_norms_keep_their_forward():
    """A norm that computes otherwise (Gemma's scales by 1 + weight) is left alone."""

    class OtherNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4))

        def forward(self, hidden_states):
            return hidden_states * (1 + self.weight)

    model = nn.Sequential(OtherNorm())
    assert fuse_elementwise(model) == 0
    assert "forward" not in vars(model[0])
