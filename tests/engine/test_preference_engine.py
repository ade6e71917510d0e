"""The DPO update on a tiny model: its loss and gradient against a hand computation (each answer's log-prob from a
plain forward, the loss by its formula, autograd through plain forwards), any micro-batching gives the same step,
identical answers leave the weights where they were, and a LoRA model's reference is itself with adapters off."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives.direct_preference import DPO_LOSS, DirectPreference
from hybridflow.algorithms.preference import PreferenceConfig
from hybridflow.batch_keys import ANSWER_LOG_PROB, METRICS, REF_ANSWER_LOG_PROB, REF_LOG_PROB, RESPONSE_MASK
from hybridflow.data.io import write_rows
from hybridflow.data.preference_dataset import CHOSEN, REJECTED, PreferenceDataset
from hybridflow.data.token_rows import LOSS_MASK, PROMPT_IDS, RESPONSE_IDS
from hybridflow.engine.lora import LoraConfig, apply_lora
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.supervised import SupervisedEngine
from hybridflow.models import load_causal_lm, load_tokenizer
from tests.data.test_preference_dataset import CONFIG as DATA
from tests.engine.test_sft_engine import ENGINE, OPTIM  # fp32, no clipping, AdamW linear in the gradient

DPO = PreferenceConfig(loss_type="sigmoid", beta=0.5, label_smoothing=0.0)
PAIRS = [
    {"prompt": [{"role": "user", "content": "What is 7 * 6?"}], "chosen": "42", "rejected": "It is 48, I think."},
    {"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": "Blue.", "rejected": "A dog"},
    {"prompt": "Two plus two is", "chosen": " four", "rejected": " five or so, more or less"},
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_path):
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    write_rows(PAIRS, path)
    return PreferenceDataset(path, load_tokenizer(tiny_path), DATA)


def tiny(tiny_path):
    torch.manual_seed(0)
    return load_causal_lm(tiny_path, dtype=torch.float32)


def perturbed(model):
    """Another model: the reference, unlike the policy, so that the log-ratios are not 0."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return other.eval().requires_grad_(False)


def engine(model, reference, preference=DPO, **changes) -> SupervisedEngine:
    return SupervisedEngine(
        TrainedModel.build(model, OPTIM, 10),
        dataclasses.replace(ENGINE, **changes),
        OPTIM,
        DirectPreference(preference),
        reference=reference,
    )


def answer_log_prob(model, row) -> torch.Tensor:
    """The summed log-prob of a row's trained tokens, one plain forward (with autograd)."""
    ids = torch.tensor([row[PROMPT_IDS] + row[RESPONSE_IDS]])
    log_probs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    start = len(row[PROMPT_IDS])
    total = torch.zeros(())
    for offset, trained in enumerate(row[LOSS_MASK]):
        if trained:
            total = total + log_probs[start + offset - 1, ids[0, start + offset]]
    return total


def hand_loss(model, reference, dataset, beta) -> torch.Tensor:
    losses = []
    for pair in dataset.pairs:
        with torch.no_grad():
            ref_chosen, ref_rejected = (answer_log_prob(reference, pair[s]) for s in (CHOSEN, REJECTED))
        chosen, rejected = (answer_log_prob(model, pair[s]) for s in (CHOSEN, REJECTED))
        h = (chosen - ref_chosen) - (rejected - ref_rejected)
        losses.append(-F.logsigmoid(beta * h))
    return torch.stack(losses).mean()


def batch_with_reference(dpo: SupervisedEngine, dataset):
    data = dataset.collate(dataset.pairs)
    data.meta_info["global_step"] = 1
    return data.union(dpo.reference_log_probs(data))


def test_the_loss_and_gradient_equal_a_hand_computation(tiny_path, pairs):
    model = tiny(tiny_path)
    reference = perturbed(model)
    by_hand = copy.deepcopy(model)
    expected = hand_loss(by_hand, reference, pairs, DPO.beta)
    expected.backward()
    expected = expected.detach()

    dpo = engine(model, reference)
    data = batch_with_reference(dpo, pairs)
    metrics = dpo.train_batch(data.select(deepcopy=True), seed=0).meta_info[METRICS]
    assert metrics[DPO_LOSS] == pytest.approx(float(expected), abs=1e-5)
    assert float(expected) != pytest.approx(0.6931, abs=1e-2)  # not log 2: the reference differs from the policy
    assert metrics["dpo/grad_norm"] > 0.1
    # the gradient: one micro-batch's backward on a fresh copy, against autograd through the plain forwards
    fresh = engine(tiny(tiny_path), reference, micro_batch_size_per_gpu=len(data))
    aggregation = LossAggregation.for_minibatch("token-mean", data.batch[RESPONSE_MASK])  # its global_seqs: 6 rows
    micro = data.select(deepcopy=True)
    loss, _ = fresh._micro_loss(micro, aggregation, fresh._forward(micro))
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=0)
    for (name, parameter), (_, hand) in zip(fresh.model.named_parameters(), by_hand.named_parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, hand.grad, atol=2e-6, rtol=1e-4, msg=name)


def test_evaluation_gives_each_answers_log_prob_under_both_models(tiny_path, pairs):
    model = tiny(tiny_path)
    reference = perturbed(model)
    dpo = engine(model, reference)
    out = dpo.evaluate(pairs.collate(pairs.pairs))
    rows = [pair[side] for pair in pairs.pairs for side in (CHOSEN, REJECTED)]
    with torch.no_grad():
        policy = torch.stack([answer_log_prob(model, row) for row in rows])
        ref = torch.stack([answer_log_prob(reference, row) for row in rows])
    torch.testing.assert_close(out.batch[ANSWER_LOG_PROB], policy, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.batch[REF_ANSWER_LOG_PROB], ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "micro",
    [
        {"micro_batch_size_per_gpu": 1},  # one pair a micro-batch (a pair is never split)
        {"micro_batch_size_per_gpu": 3, "use_remove_padding": False},
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30},
    ],
    ids=["one-pair", "padded", "by-token-count"],
)
def test_micro_batches_accumulate_to_the_whole_batch_step(tiny_path, pairs, micro):
    reference = perturbed(tiny(tiny_path))
    whole = engine(tiny(tiny_path), reference, micro_batch_size_per_gpu=6)
    data = batch_with_reference(whole, pairs)
    whole_metrics = whole.train_batch(data.select(deepcopy=True), seed=0).meta_info[METRICS]
    split = engine(tiny(tiny_path), reference, **micro)
    split_metrics = split.train_batch(data.select(deepcopy=True), seed=0).meta_info[METRICS]
    for key in (DPO_LOSS, "dpo/reward_accuracy", "dpo/chosen_reward", "dpo/reward_margin"):
        assert split_metrics[key] == pytest.approx(whole_metrics[key], abs=1e-6), key
    for (name, weight), (_, expected) in zip(split.model.named_parameters(), whole.model.named_parameters()):
        torch.testing.assert_close(weight, expected, atol=2e-7, rtol=0, msg=name)


def test_identical_answers_give_log_2_and_leave_the_weights_where_they_were(tiny_path, pairs):
    same = copy.deepcopy(pairs)
    for pair in same.pairs:
        pair[REJECTED] = copy.deepcopy(pair[CHOSEN])
    model = tiny(tiny_path)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    dpo = engine(model, perturbed(model))
    metrics = dpo.train_batch(batch_with_reference(dpo, same), seed=0).meta_info[METRICS]
    assert metrics[DPO_LOSS] == pytest.approx(0.693147, abs=1e-6)  # log 2
    # d loss / d h = −β/2, times ∇ log π(chosen) − ∇ log π(rejected) = 0: what is left is float rounding of two
    # equal gradients summed through different paths (~1e-6 against a norm of ~1 for a real pair)
    assert metrics["dpo/grad_norm"] < 1e-5
    for name, parameter in dpo.model.named_parameters():
        torch.testing.assert_close(parameter, before[name], atol=1e-8, rtol=0, msg=name)


def test_a_lora_models_reference_is_itself_with_adapters_off(tiny_path, pairs):
    """At the start the adapters add 0: the policy is the reference, every h is 0 and the loss log 2; after a step
    the reference pass (adapters off) still gives the base model's log-probs."""
    base = tiny(tiny_path)
    model = apply_lora(
        copy.deepcopy(base),
        LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"], target_parameters=[]),
    )
    dpo = engine(model, None)
    data = batch_with_reference(dpo, pairs)
    metrics = dpo.train_batch(data.select(deepcopy=True), seed=0).meta_info[METRICS]
    assert metrics[DPO_LOSS] == pytest.approx(0.693147, abs=1e-6)
    assert metrics["dpo/grad_norm"] > 0  # B = 0 but A's gradient through B is 0, B's is not
    after = dpo.reference_log_probs(data)
    torch.testing.assert_close(after.batch[REF_LOG_PROB], data.batch[REF_LOG_PROB], atol=1e-5, rtol=0)
    moved = dpo.evaluate(data)
    assert not torch.allclose(moved.batch[ANSWER_LOG_PROB], moved.batch[REF_ANSWER_LOG_PROB])
