"""The SFT update: its loss is the mean negative log-likelihood of the trained tokens (checked against a plain
forward of each sequence), and packed or padded batches, and any micro-batching, give the same loss and gradients."""

import dataclasses

import pytest
import torch

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives import OBJECTIVES
from hybridflow.batch_keys import LOSS_TOKENS, METRICS, NLL_SUM, RESPONSE_MASK
from hybridflow.batch_keys import SFT_LOSS as LOSS
from hybridflow.data import SFTDataset
from hybridflow.data.io import write_rows
from hybridflow.data.sft_dataset import LOSS_MASK, PROMPT_IDS, RESPONSE_IDS
from hybridflow.engine.config import FSDPConfig, SFTEngineConfig
from hybridflow.engine.optim import OptimConfig, TrainedModel
from hybridflow.engine.supervised import SupervisedEngine
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.trainer.setup.sft_config import load_sft_config

ENGINE = SFTEngineConfig(
    micro_batch_size_per_gpu=2,
    use_remove_padding=True,
    use_dynamic_bsz=False,
    max_token_len_per_gpu=64,
    tensor_model_parallel_size=1,
    ulysses_sequence_parallel_size=1,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=1,
    grad_clip=1e9,  # no clipping: the gradients compare as computed
    reshard_after_forward=True,
    fsdp=FSDPConfig(param_dtype="fp32", reduce_dtype="fp32", host_collectives=True),
)
# AdamW's first step with eps=1 is linear in the gradient for gradients far below 1: weights compare like gradients
OPTIM = OptimConfig(
    lr=1e-2, weight_decay=0.0, betas=[0.9, 0.999], eps=1.0, lr_warmup_steps=0, lr_scheduler="constant", min_lr_ratio=0
)
ROWS = [
    {
        "messages": [
            {"role": "user", "content": "What is 7 * 6?"},
            {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "It is 42."},
        ]
    },
    {"prompt": [{"role": "user", "content": "2+2?"}], "response": "4"},
    {"prompt": "A long prompt with several words in it:", "response": " and a longer answer after it"},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"},
        ]
    },  # fmt: skip
]


@pytest.fixture(scope="module")
def batch(tmp_path_factory, tiny_path):
    path = tmp_path_factory.mktemp("sft") / "rows.jsonl"
    write_rows(ROWS, path)
    data = load_sft_config().data
    dataset = SFTDataset(path, load_tokenizer(tiny_path), data)
    return dataset, dataset.collate(dataset.rows)


def engine(tiny_path, **changes) -> SupervisedEngine:
    torch.manual_seed(0)
    model = load_causal_lm(tiny_path, dtype=torch.float32)
    return SupervisedEngine(
        TrainedModel.build(model, OPTIM, 10), dataclasses.replace(ENGINE, **changes), OPTIM, OBJECTIVES.get("sft")()
    )


def independent_nll(model, dataset) -> list[tuple[float, int]]:
    """Each sample's summed negative log-likelihood of its trained tokens and their count, one plain forward each."""
    out = []
    with torch.no_grad():
        for row in dataset.rows:
            ids = torch.tensor([row[PROMPT_IDS] + row[RESPONSE_IDS]])
            log_probs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            start = len(row[PROMPT_IDS])
            nll, count = 0.0, 0
            for offset, trained in enumerate(row[LOSS_MASK]):
                if trained:
                    position = start + offset
                    nll -= float(log_probs[position - 1, ids[0, position]])
                    count += 1
            out.append((nll, count))
    return out


def test_the_loss_is_the_mean_nll_of_the_trained_tokens_and_evaluation_gives_each_rows(tiny_path, batch):
    dataset, data = batch
    sft = engine(tiny_path)
    expected = independent_nll(sft.model, dataset)
    evaluated = sft.evaluate(data.select(deepcopy=True))
    torch.testing.assert_close(evaluated.batch[NLL_SUM], torch.tensor([n for n, _ in expected]), atol=1e-4, rtol=1e-5)
    assert evaluated.batch[LOSS_TOKENS].tolist() == [float(c) for _, c in expected]
    data.meta_info["global_step"] = 1
    loss = sft.train_batch(data.select(deepcopy=True), seed=0).meta_info[METRICS][LOSS]
    assert loss == pytest.approx(sum(n for n, _ in expected) / sum(c for _, c in expected), abs=1e-5)


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(tiny_path, batch):
    _, data = batch
    results = []
    for packed in (True, False):
        sft = engine(tiny_path, use_remove_padding=packed)
        agg = LossAggregation.for_minibatch("token-mean", data.batch[RESPONSE_MASK])
        micro = data.select(deepcopy=True)
        loss, _ = sft._micro_loss(micro, agg, sft._forward(micro))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in sft.model.named_parameters()}))
    (packed_loss, packed_grads), (padded_loss, padded_grads) = results
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-5, rtol=0)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "micro",
    [
        {"micro_batch_size_per_gpu": 1},
        {"micro_batch_size_per_gpu": 3, "use_remove_padding": False},
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 40},
    ],
    ids=["one-row", "padded-three-rows", "by-token-count"],
)
def test_micro_batches_accumulate_to_the_whole_batch_step(tiny_path, batch, micro):
    _, data = batch
    data.meta_info["global_step"] = 1
    whole = engine(tiny_path, micro_batch_size_per_gpu=len(data))
    whole_loss = whole.train_batch(data.select(deepcopy=True), seed=0).meta_info[METRICS][LOSS]
    split = engine(tiny_path, **micro)
    split_loss = split.train_batch(data.select(deepcopy=True), seed=0).meta_info[METRICS][LOSS]
    assert split_loss == pytest.approx(whole_loss, abs=1e-5)
    moved = False
    for (name, weight), (_, expected) in zip(split.model.named_parameters(), whole.model.named_parameters()):
        torch.testing.assert_close(weight, expected, atol=2e-7, rtol=0, msg=name)
    fresh = engine(tiny_path)
    for (_, weight), (_, before) in zip(whole.model.named_parameters(), fresh.model.named_parameters()):
        moved |= not torch.equal(weight, before)
    assert moved, "the step changed no weight"
