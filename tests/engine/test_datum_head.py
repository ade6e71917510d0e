"""The datum pass gives the output head the hidden states and has it return the log-probs (engine/datum_pass.py
``datum_log_probs``): autograd at the positions whose loss can have a gradient (weight or advantage non-zero), no
autograd and a chunk of rows at a time elsewhere. Its log-probs, losses and every gradient equal those of the plain
pass (the whole logits, the head with autograd everywhere), fp32, for each loss, with the head adapted by LoRA and
with every weight trained; a model whose forward changes the head's output falls back to the logits, exactly."""

import numpy as np
import pytest
import torch

from hybridflow.algorithms.datum_losses import Datum
from hybridflow.algorithms.objectives import datum_objective, datum_objectives
from hybridflow.engine import datum_pass
from hybridflow.engine.datum_pass import head_gradient_at, run_datums
from hybridflow.engine.forward import response_log_probs
from hybridflow.engine.lora import ALL_LINEAR, OUTPUT_HEAD, LoraConfig, apply_lora
from hybridflow.models import load_causal_lm

CPU = torch.device("cpu")


def datums(vocab: int, seed: int = 0) -> list[Datum]:
    g = np.random.default_rng(seed)
    out = []
    for length in (5, 9, 7, 12):
        tokens = g.integers(3, vocab, size=length + 1)
        trained = (g.random(length) > 0.6).astype(np.float32)  # most positions untrained, as in a chat's prompt
        inputs = {
            "target_tokens": tokens[1:],
            "weights": trained * g.random(length).astype(np.float32),
            "advantages": trained * g.normal(size=length).astype(np.float32),
            "logprobs": -g.random(length).astype(np.float32) * 3,
        }
        out.append(Datum(tokens[:-1], inputs))
    return out


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def plain_log_probs(model, micro, trained):
    """The pass without any of the head's savings: the whole logits, with autograd at every position."""
    return response_log_probs(model, micro, remove_padding=True)[0]


def run(model, data, loss, monkeypatch, split: bool):
    if not split:
        monkeypatch.setattr(datum_pass, "datum_log_probs", plain_log_probs)
    model.zero_grad(set_to_none=True)
    outputs, total = run_datums(
        model, data, datum_objective(loss)(), backward=True, max_tokens=24, device=CPU, loss_scale=2.0
    )
    monkeypatch.undo()
    return outputs, total, gradients(model)


def assert_same_pass(split, plain):
    (split_outputs, split_total, split_grads), (plain_outputs, plain_total, plain_grads) = split, plain
    assert split_total == pytest.approx(plain_total, rel=1e-6)
    for a, b in zip(split_outputs, plain_outputs):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a.elementwise_loss, b.elementwise_loss, rtol=1e-6, atol=1e-6)
    assert split_grads.keys() == plain_grads.keys() and len(split_grads) > 0
    for name, grad in plain_grads.items():
        # the head's chunks sum in another order: fp32 rounding at the tensor's scale, which an entry near zero can
        # exceed relative to itself (2.3x rtol=1e-5 on a Zen 4 host, within it on the Intel host)
        scale = float(grad.abs().max())
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-5, atol=1e-6 * scale + 1e-7, msg=name)


@pytest.mark.parametrize("loss", datum_objectives())
@pytest.mark.parametrize("lora", [True, False])
def test_gradients_logprobs_and_losses_equal_the_plain_pass(tiny_path, monkeypatch, loss, lora):
    torch.manual_seed(0)
    model = load_causal_lm(tiny_path, dtype=torch.float32)
    if lora:
        config = LoraConfig(
            rank=4, alpha=8.0, dropout=0.0, target_modules=[ALL_LINEAR, OUTPUT_HEAD], target_parameters=[]
        )
        model = apply_lora(model, config)
        for name, p in model.named_parameters():  # B != 0: the adapters change the outputs and get gradients
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    data = datums(model.config.vocab_size)
    head = model.get_output_embeddings()
    rows = []  # the head runs on the datums' positions only (logits_to_keep, through peft too): what it splits
    head.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[1]))
    monkeypatch.setattr(datum_pass, "HEAD_CHUNK_BYTES", 3 * 4 * model.config.vocab_size)  # 3 rows a chunk
    split = run(model, data, loss, monkeypatch, split=True)
    plain = run(model, data, loss, monkeypatch, split=False)
    assert sum(rows) == 2 * sum(len(d.tokens) for d in data)
    assert datum_pass._HEAD_GIVES_LOG_PROBS.get(model, True)  # the head gave the log-probs: no fall-back
    assert any(p.grad is not None for p in head.parameters())  # the head itself is trained (LoRA or weight)
    assert_same_pass(split, plain)
    assert "forward" not in head.__dict__  # the head's own forward is back


def with_scaled_logits(model):
    """``model`` whose forward halves its head's output (as a logit scale or soft cap does after the head)."""

    class ScaledLogits(type(model)):
        def forward(self, *args, logits_to_keep=0, **kwargs):
            out = super().forward(*args, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits * 0.5
            return out

    model.__class__ = ScaledLogits
    return model


def test_a_forward_that_changes_the_heads_output_gets_the_plain_pass(tiny_path, monkeypatch):
    torch.manual_seed(0)
    model = with_scaled_logits(load_causal_lm(tiny_path, dtype=torch.float32))
    data = datums(model.config.vocab_size, seed=1)
    split = run(model, data, "importance_sampling", monkeypatch, split=True)
    assert datum_pass._HEAD_GIVES_LOG_PROBS[model] is False  # seen at the first micro-batch, then kept
    plain = run(model, data, "importance_sampling", monkeypatch, split=False)
    assert_same_pass(split, plain)
    scaled = torch.log_softmax(model(torch.as_tensor(data[0].tokens)[None]).logits[0], dim=-1)
    expected = scaled.gather(1, torch.as_tensor(data[0].inputs["target_tokens"])[:, None])[:, 0]
    np.testing.assert_allclose(split[0][0].logprobs, expected.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_only_the_trained_positions_reach_the_heads_autograd(tiny_path):
    model = load_causal_lm(tiny_path, dtype=torch.float32)
    head = model.get_output_embeddings()
    seen = []
    head.register_forward_hook(lambda module, inputs, output: seen.append(output.requires_grad))
    hidden = torch.randn(1, 5, model.config.hidden_size, requires_grad=True)
    trained = torch.tensor([False, True, False, False, True])
    with head_gradient_at(model, trained):
        out = head(hidden)
    plain = head(hidden)
    torch.testing.assert_close(out, plain)
    (out[0, :, 0].sum()).backward()
    assert hidden.grad[0, trained].abs().sum() > 0 and hidden.grad[0, ~trained].abs().sum() == 0
    assert "forward" not in head.__dict__
