"""A new supervised objective is one class and one registry line: the one supervised engine then trains with it and
evaluates with it, through the packed forward and any micro-batching, with nothing else written. The objective made up
here is the mean over answers of each answer's summed negative log-likelihood (a sequence-level loss, unlike SFT's
token mean), checked against a plain forward of each sample; then the registry's own checks."""

import dataclasses

import pytest
import torch

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives import OBJECTIVES, ForwardOutputs, Objective
from hybridflow.algorithms.objectives.nll import NegativeLogLikelihood
from hybridflow.batch_keys import METRICS, RESPONSE_MASK
from hybridflow.data.sft_dataset import LOSS_MASK, PROMPT_IDS, RESPONSE_IDS
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.supervised import SupervisedEngine
from hybridflow.models import load_causal_lm
from tests.engine.test_sft_engine import ENGINE, OPTIM, independent_nll
from tests.engine.test_sft_engine import batch as batch  # noqa: F401 (the fixture: four samples, tiny-llama's tokens)

ANSWER_NLL = "answer_nll/loss"
ANSWER_NLL_SUM = "answer_nll_sum"


class AnswerNLL(Objective):
    """Each answer's summed NLL, averaged over the batch's answers on all ranks; held out, the same mean."""

    name = "answer_nll"
    share_keys = (ANSWER_NLL,)
    shown = ((ANSWER_NLL, "loss"),)

    def loss(self, outputs: ForwardOutputs, batch, agg: LossAggregation):
        answers = max(agg.global_seqs or 0.0, 1.0)
        loss = -(outputs.log_probs * batch[RESPONSE_MASK]).sum() / answers
        return loss, {ANSWER_NLL: loss.detach()}

    def held_out_rows(self, outputs: ForwardOutputs, batch):
        return {ANSWER_NLL_SUM: -(outputs.log_probs * batch[RESPONSE_MASK]).sum(dim=1)}

    def held_out_metrics(self, rows):
        return {"val/answer_nll": float(rows[ANSWER_NLL_SUM].double().mean())}


@pytest.fixture(scope="module")
def registered():
    OBJECTIVES.add(AnswerNLL.name, AnswerNLL)  # the registry line
    yield OBJECTIVES.get(AnswerNLL.name)


def engine(tiny_path, objective: Objective, **changes) -> SupervisedEngine:
    torch.manual_seed(0)
    model = load_causal_lm(tiny_path, dtype=torch.float32)
    config = dataclasses.replace(ENGINE, **changes)
    return SupervisedEngine(TrainedModel.build(model, OPTIM, 10), config, OPTIM, objective)


def test_a_made_up_objective_trains_and_evaluates_by_its_own_loss(tiny_path, batch, registered):  # noqa: F811
    dataset, data = batch
    made_up = engine(tiny_path, registered())
    expected = independent_nll(made_up.model, dataset)  # (summed NLL, tokens) per sample, one plain forward each
    mean_answer_nll = sum(nll for nll, _ in expected) / len(expected)
    held_out = made_up.objective.held_out_metrics(made_up.evaluate(data.select(deepcopy=True)).batch)
    assert held_out["val/answer_nll"] == pytest.approx(mean_answer_nll, abs=1e-4)
    data.meta_info["global_step"] = 1
    metrics = made_up.train_batch(data.select(deepcopy=True), seed=0).meta_info[METRICS]
    assert metrics[ANSWER_NLL] == pytest.approx(mean_answer_nll, abs=1e-4)
    assert metrics["perf/tflops_answer_nll_update"] > 0 and "answer_nll/grad_norm" in metrics
    # not SFT's token mean: the two differ on samples of different lengths
    token_mean = sum(nll for nll, _ in expected) / sum(count for _, count in expected)
    assert abs(metrics[ANSWER_NLL] - token_mean) > 0.1


def test_its_step_is_autograd_of_plain_forwards_whatever_the_micro_batching(tiny_path, batch, registered):  # noqa: F811
    dataset, data = batch
    data.meta_info["global_step"] = 1
    whole = engine(tiny_path, registered(), micro_batch_size_per_gpu=len(data))
    whole.train_batch(data.select(deepcopy=True), seed=0)
    for micro in ({"micro_batch_size_per_gpu": 1}, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 40}):
        split = engine(tiny_path, registered(), **micro)
        split.train_batch(data.select(deepcopy=True), seed=0)
        for (name, weight), (_, expected) in zip(split.model.named_parameters(), whole.model.named_parameters()):
            torch.testing.assert_close(weight, expected, atol=2e-7, rtol=0, msg=name)
    packed = engine(tiny_path, registered())
    agg = LossAggregation.for_minibatch("token-mean", data.batch[RESPONSE_MASK])
    micro = data.select(deepcopy=True)
    loss, _ = packed._micro_loss(micro, agg, packed._forward(micro))
    loss.backward()
    plain = engine(tiny_path, registered())  # the same weights: autograd through one plain forward per sample
    expected = torch.stack([answer_nll_by_hand(plain.model, row) for row in dataset.rows]).mean()
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=0)
    for (name, parameter), (_, other) in zip(packed.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(parameter.grad, other.grad, atol=1e-5, rtol=1e-4, msg=name)


def answer_nll_by_hand(model, row) -> torch.Tensor:
    """A sample's summed NLL of its trained tokens, one plain forward with autograd."""
    ids = torch.tensor([row[PROMPT_IDS] + row[RESPONSE_IDS]])
    log_probs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    start = len(row[PROMPT_IDS])
    trained = [start + offset for offset, kept in enumerate(row[LOSS_MASK]) if kept]
    return -sum(log_probs[position - 1, ids[0, position]] for position in trained)


def test_the_registry_refuses_a_taken_name_and_names_the_known_ones():
    with pytest.raises(ValueError, match="objective 'sft' is already registered"):
        OBJECTIVES.add("sft", NegativeLogLikelihood)
    known = "cross_entropy, dpo, importance_sampling, policy, ppo, rm, sft, value"
    with pytest.raises(ValueError, match=f"unknown objective 'nope'.*{known}"):
        OBJECTIVES.get("nope")


def test_an_objective_without_a_reference_refuses_a_reference_pass(tiny_path, batch):  # noqa: F811
    _, data = batch
    with pytest.raises(ValueError, match="the 'sft' objective has no reference"):
        engine(tiny_path, NegativeLogLikelihood()).reference_log_probs(data)
