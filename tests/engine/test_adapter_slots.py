"""Many adapters over one base (engine/adapter_slots.py) with datum passes (engine/datum_pass.py), fp32 on a tiny
model: a rank-r adapter of some layers in a wider slot trains exactly as a peft adapter of its own shape alone;
adapters interleaved in the slot keep their own tensors, gradients and AdamW state; saved and loaded with the
optimizer state a run goes on as if never saved; passes accumulate gradients as one pass over all datums."""

import numpy as np
import pytest
import torch

from hybridflow.algorithms.datum_losses import Datum
from hybridflow.algorithms.objectives import datum_objective
from hybridflow.engine.adapter_slots import AdapterSlots
from hybridflow.engine.datum_pass import run_datums
from hybridflow.engine.lora import ADAPTER, ALL_LINEAR, OUTPUT_HEAD, LoraConfig, apply_lora
from hybridflow.models import load_causal_lm
from hybridflow.models.adapters import ATTN, MLP, UNEMBED

CPU = torch.device("cpu")
CROSS_ENTROPY = datum_objective("cross_entropy")()
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def slotted(path: str, max_rank: int = 8, head: bool = False) -> AdapterSlots:
    targets = [ALL_LINEAR, OUTPUT_HEAD] if head else [ALL_LINEAR]
    model = apply_lora(
        load_causal_lm(path, dtype=torch.float32),
        LoraConfig(rank=max_rank, alpha=float(max_rank), dropout=0.0, target_modules=targets, target_parameters=[]),
    )
    return AdapterSlots(model, max_rank)


def datums(vocab: int, seed: int, count: int = 3) -> list[Datum]:
    g = np.random.default_rng(seed)
    out = []
    for length in g.integers(4, 11, size=count):
        tokens = g.integers(3, vocab, size=length + 1)
        weights = (g.random(length) > 0.3).astype(np.float32)
        out.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return out


def train_step(slots: AdapterSlots, key: str, data: list[Datum]) -> float:
    slots.activate(key)
    _, loss = run_datums(slots.model, data, CROSS_ENTROPY, backward=True, max_tokens=64, device=CPU)
    slots.step(**ADAM)
    return loss


def logprobs(slots: AdapterSlots, key: str, data: list[Datum]) -> list[np.ndarray]:
    slots.activate(key)
    outputs, _ = run_datums(slots.model, data, CROSS_ENTROPY, backward=False, max_tokens=64, device=CPU)
    return [o.logprobs for o in outputs]


@pytest.mark.parametrize(
    "parts, alone_targets, head",
    [
        ({ATTN}, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
        ({MLP, UNEMBED}, ["gate_proj", "up_proj", "down_proj", "lm_head"], True),  # the output head (train_unembed)
    ],
)
def test_a_narrow_adapter_in_the_slot_trains_as_it_would_alone(tiny_path, parts, alone_targets, head):
    slots = slotted(tiny_path, max_rank=8, head=head)
    slots.create("a", rank=2, parts=frozenset(parts), scaling=3.0, seed=5)
    alone = apply_lora(
        load_causal_lm(tiny_path, dtype=torch.float32),
        LoraConfig(rank=2, alpha=6.0, dropout=0.0, target_modules=alone_targets, target_parameters=[]),
    )
    start = slots.adapter_tensors("a")  # the same initial adapters in both
    layers = alone.config.num_hidden_layers
    assert len(start) == 2 * sum(1 for name, _ in alone.named_parameters() if ".lora_A." in name)
    assert len(start) == (2 * 4 * layers if parts == {ATTN} else 2 * (3 * layers + 1))
    with torch.no_grad():
        for name, param in alone.named_parameters():
            if "lora_" in name:
                layer = name.removeprefix("base_model.model.").split(".lora_")[0]
                part = "lora_A" if ".lora_A." in name else "lora_B"
                param.copy_(start[f"{layer}.{part}"])
    optimizer = torch.optim.AdamW([p for p in alone.parameters() if p.requires_grad], **ADAM)
    vocab = alone.config.vocab_size
    ran = set()  # the slot's layers whose adapter computed: those of the adapter's parts only (the rest are zero)
    for layer in slots.layers:
        layer.module.lora_A[ADAPTER].register_forward_hook(lambda module, i, o, name=layer.name: ran.add(name))
    for step in range(3):
        data = datums(vocab, seed=step)
        slot_loss = train_step(slots, "a", data)
        optimizer.zero_grad()
        _, alone_loss = run_datums(alone, data, CROSS_ENTROPY, backward=True, max_tokens=64, device=CPU)
        optimizer.step()
        assert slot_loss == pytest.approx(alone_loss, rel=1e-6)
    assert ran == {layer.name for layer in slots.layers if layer.part in parts}
    held_out = datums(vocab, seed=99)
    expected, _ = run_datums(alone, held_out, CROSS_ENTROPY, backward=False, max_tokens=64, device=CPU)
    for got, want in zip(logprobs(slots, "a", held_out), expected):
        np.testing.assert_allclose(got, want.logprobs, atol=1e-5)
    # the rows and columns beyond rank 2 and the layers of other parts stayed exactly zero; the adapted ones trained
    for layer in slots.layers:
        a, b = slots.params[layer.a_name], slots.params[layer.b_name]
        assert not a[2:].any() and not b[:, 2:].any()
        assert bool(b.any()) == (layer.part in parts)


def test_interleaved_adapters_keep_their_own_gradients_and_optimizer_state(tiny_path):
    vocab = load_causal_lm(tiny_path).config.vocab_size
    both = slotted(tiny_path)
    for key, seed in (("a", 1), ("b", 2)):
        both.create(key, rank=4, parts=frozenset({ATTN, MLP}), scaling=1.0, seed=seed)
    # a: forward_backward, then b's whole step, then a's second pass and step: a's gradients wait in its state
    for step in range(2):
        both.activate("a")
        run_datums(both.model, datums(vocab, 10 + step), CROSS_ENTROPY, backward=True, max_tokens=64, device=CPU)
        train_step(both, "b", datums(vocab, 20 + step))
        both.activate("a")
        run_datums(both.model, datums(vocab, 30 + step), CROSS_ENTROPY, backward=True, max_tokens=64, device=CPU)
        both.step(**ADAM)
    alone = slotted(tiny_path)
    alone.create("a", rank=4, parts=frozenset({ATTN, MLP}), scaling=1.0, seed=1)
    for step in range(2):  # two passes accumulate as one pass over both datum lists
        train_step(alone, "a", datums(vocab, 10 + step) + datums(vocab, 30 + step))
    held_out = datums(vocab, seed=7)
    for got, want in zip(logprobs(both, "a", held_out), logprobs(alone, "a", held_out)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    untouched = slotted(tiny_path)
    untouched.create("b", rank=4, parts=frozenset({ATTN, MLP}), scaling=1.0, seed=2)
    for step in range(2):
        train_step(untouched, "b", datums(vocab, 20 + step))
    for got, want in zip(logprobs(both, "b", held_out), logprobs(untouched, "b", held_out)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_saved_with_its_optimizer_state_a_run_goes_on_as_if_never_saved(tiny_path, tmp_path):
    vocab = load_causal_lm(tiny_path).config.vocab_size
    slots = slotted(tiny_path)
    slots.create("a", rank=3, parts=frozenset({ATTN, MLP}), scaling=2.0, seed=4)
    train_step(slots, "a", datums(vocab, 1))
    slots.save("a", tmp_path / "state", with_optimizer=True, write=True)
    slots.save("a", tmp_path / "weights", with_optimizer=False, write=True)
    slots.load("resumed", tmp_path / "state", rank=3, parts=frozenset({ATTN, MLP}), scaling=2.0, with_optimizer=True)
    slots.load(
        "fresh_moments", tmp_path / "weights", rank=3, parts=frozenset({ATTN, MLP}), scaling=2.0, with_optimizer=False
    )
    for key in ("a", "resumed", "fresh_moments"):
        train_step(slots, key, datums(vocab, 2))
    held_out = datums(vocab, seed=8)
    original, resumed, fresh = (logprobs(slots, key, held_out) for key in ("a", "resumed", "fresh_moments"))
    for got, want in zip(resumed, original):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert not all(np.allclose(f, o, atol=1e-4) for f, o in zip(fresh, original))  # the moments mattered
    with pytest.raises(FileNotFoundError, match="without its optimizer state"):
        slots.load("x", tmp_path / "weights", rank=3, parts=frozenset({ATTN}), scaling=2.0, with_optimizer=True)
    with pytest.raises(ValueError, match="should be"):
        slots.load("y", tmp_path / "weights", rank=4, parts=frozenset({ATTN}), scaling=2.0, with_optimizer=False)


def test_a_forward_only_pass_adds_no_gradient_and_datum_logprobs_are_the_models(tiny_path):
    slots = slotted(tiny_path)
    slots.create("a", rank=2, parts=frozenset({ATTN}), scaling=1.0, seed=0)
    slots.activate("a")
    data = datums(slots.model.config.vocab_size, 3)
    outputs, loss = run_datums(slots.model, data, CROSS_ENTROPY, backward=False, max_tokens=64, device=CPU)
    assert all(p.grad is None for p in slots.model.parameters())
    with torch.no_grad():  # one datum alone, by hand
        d = data[1]
        logits = slots.model(input_ids=torch.as_tensor(d.tokens)[None]).logits[0]
        want = torch.log_softmax(logits, -1)[torch.arange(len(d.tokens)), torch.as_tensor(d.inputs["target_tokens"])]
    np.testing.assert_allclose(outputs[1].logprobs, want.numpy(), atol=1e-5)
    by_hand = -sum(float((o.logprobs * d.inputs["weights"]).sum()) for o, d in zip(outputs, data))
    assert loss == pytest.approx(by_hand, rel=1e-6)


def test_creation_is_refused_outside_the_slot(tiny_path):
    slots = slotted(tiny_path, max_rank=4)
    with pytest.raises(ValueError, match="outside 1..4"):
        slots.create("a", rank=8, parts=frozenset({ATTN}), scaling=1.0, seed=0)
    with pytest.raises(ValueError, match="do not reach"):
        slots.create("a", rank=2, parts=frozenset({"unembed"}), scaling=1.0, seed=0)
    slots.create("a", rank=2, parts=frozenset({ATTN}), scaling=1.0, seed=0)
    with pytest.raises(ValueError, match="exists"):
        slots.create("a", rank=2, parts=frozenset({ATTN}), scaling=1.0, seed=0)
    with pytest.raises(ValueError, match="not a setting of cross_entropy"):
        datum_objective("cross_entropy")({"clip_low_threshold": 0.5})


def test_the_packed_datum_pass_gives_each_target_s_log_prob_and_micro_batching_changes_nothing(tiny_path):
    """Each datum's log-probs are log p(target_i | tokens[: i + 1]) from one plain forward of the datum alone (targets
    other than the next token too), and a budget of one datum per micro-batch gives the outputs and gradients of one
    micro-batch of all."""
    model = load_causal_lm(tiny_path, dtype=torch.float32)
    data = datums(model.config.vocab_size, seed=5, count=4)
    data[1] = Datum(data[1].tokens, {**data[1].inputs, "target_tokens": data[1].inputs["target_tokens"][::-1].copy()})
    data.append(Datum(np.array([7]), {"target_tokens": np.array([9]), "weights": np.array([1.0])}))  # one token
    results = []
    for budget in (1, 1000):
        model.zero_grad(set_to_none=True)
        outputs, loss = run_datums(model, data, CROSS_ENTROPY, backward=True, max_tokens=budget, device=CPU)
        results.append((outputs, loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    with torch.no_grad():
        for datum, output in zip(data, results[0][0]):
            log_probs = torch.log_softmax(
                model(input_ids=torch.as_tensor(datum.tokens).unsqueeze(0)).logits[0].float(), dim=-1
            )
            expected = log_probs[torch.arange(len(datum.tokens)), torch.tensor(datum.inputs["target_tokens"])]
            np.testing.assert_allclose(output.logprobs, expected.numpy(), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(output.elementwise_loss, -datum.inputs["weights"] * output.logprobs, atol=1e-6)
    (alone, alone_loss, alone_grads), (together, together_loss, together_grads) = results
    assert alone_loss == pytest.approx(together_loss, rel=1e-6)
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(grad, together_grads[name], atol=1e-5, rtol=1e-5, msg=name)
