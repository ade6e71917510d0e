"""Bradley-Terry training of a reward model on a tiny model: its loss (with margins) and gradient against a hand
computation that scores each answer as the RL reward worker does (the conversation through the chat template,
tokenised whole, one plain forward), packed and padded passes give the same scores, any micro-batching gives the same
step, and the score is read at the last token that is not the pad token."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives.bradley_terry import RM_LOSS, BradleyTerry
from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, METRICS, RESPONSE_MASK, SEQUENCE_SCORE
from hybridflow.data.io import write_rows
from hybridflow.data.reward_pairs import RewardPairDataset
from hybridflow.engine.lora import LoraConfig, apply_lora
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.sequence_scores import score_columns
from hybridflow.engine.supervised import SupervisedEngine
from hybridflow.models import load_reward_model, load_tokenizer
from tests.data.test_preference_dataset import CONFIG as DATA
from tests.engine.test_preference_engine import PAIRS
from tests.engine.test_sft_engine import ENGINE, OPTIM  # fp32, no clipping, AdamW linear in the gradient

MARGINS = [0.5, 0.0, -1.0]
DATA_WITH_MARGIN = dataclasses.replace(DATA, margin_key="margin")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, reward_model_dir):
    path = tmp_path_factory.mktemp("rm") / "pairs.jsonl"
    write_rows([{**row, "margin": m} for row, m in zip(PAIRS, MARGINS, strict=True)], path)
    return RewardPairDataset(path, load_tokenizer(reward_model_dir), DATA_WITH_MARGIN)


def reward_model(reward_model_dir):
    return load_reward_model(reward_model_dir, dtype=torch.float32)


def engine(model, **changes) -> SupervisedEngine:
    return SupervisedEngine(
        TrainedModel.build(model, OPTIM, 10),
        dataclasses.replace(ENGINE, **changes),
        OPTIM,
        BradleyTerry(),
        pad_token_id=model.config.pad_token_id,
    )


def worker_score(model, tokenizer, prompt, answer) -> torch.Tensor:
    """The RL reward worker's computation (workers/reward_model.py), for one conversation."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False)
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return model(**encoded).logits[0, 0]


def hand_loss(model, tokenizer) -> torch.Tensor:
    losses = [
        -F.logsigmoid(
            worker_score(model, tokenizer, row["prompt"], row["chosen"])
            - worker_score(model, tokenizer, row["prompt"], row["rejected"])
            - margin
        )
        for row, margin in zip(PAIRS, MARGINS, strict=True)
    ]
    return torch.stack(losses).mean()


def batch(dataset):
    data = dataset.collate(dataset.pairs)
    data.meta_info["global_step"] = 1
    return data


def test_the_loss_and_gradient_equal_a_hand_computation(reward_model_dir, pairs):
    tokenizer = load_tokenizer(reward_model_dir)
    by_hand = reward_model(reward_model_dir)
    expected = hand_loss(by_hand, tokenizer)
    expected.backward()
    expected = expected.detach()
    assert float(expected) != pytest.approx(0.6931, abs=1e-2)  # the random head tells the answers apart

    rm = engine(reward_model(reward_model_dir))
    metrics = rm.train_batch(batch(pairs), seed=0).meta_info[METRICS]
    assert metrics[RM_LOSS] == pytest.approx(float(expected), abs=1e-5)
    assert metrics["rm/grad_norm"] > 0.1
    fresh = engine(reward_model(reward_model_dir), micro_batch_size_per_gpu=6)
    data = batch(pairs)
    aggregation = LossAggregation.for_minibatch("token-mean", data.batch[RESPONSE_MASK])
    loss, _ = fresh._micro_loss(data, aggregation, fresh._forward(data))
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=0)
    for (name, parameter), (_, hand) in zip(fresh.model.named_parameters(), by_hand.named_parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, hand.grad, atol=2e-6, rtol=1e-4, msg=name)


def test_packed_and_padded_scores_equal_the_worker_s(reward_model_dir, pairs):
    tokenizer = load_tokenizer(reward_model_dir)
    model = reward_model(reward_model_dir)
    with torch.no_grad():
        sides = [(row["prompt"], row[side]) for row in PAIRS for side in ("chosen", "rejected")]
        expected = torch.stack([worker_score(model, tokenizer, prompt, answer) for prompt, answer in sides])
    for remove_padding in (True, False):
        rm = engine(copy.deepcopy(model), use_remove_padding=remove_padding, micro_batch_size_per_gpu=4)
        scores = rm.evaluate(batch(pairs)).batch[SEQUENCE_SCORE]
        torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5, msg=f"remove_padding={remove_padding}")


@pytest.mark.parametrize(
    "micro",
    [
        {"micro_batch_size_per_gpu": 2},  # one pair a micro-batch (a pair is never split)
        {"micro_batch_size_per_gpu": 4, "use_remove_padding": False},
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 60},
    ],
    ids=["one-pair", "padded", "by-token-count"],
)
def test_micro_batches_accumulate_to_the_whole_batch_step(reward_model_dir, pairs, micro):
    whole = engine(reward_model(reward_model_dir), micro_batch_size_per_gpu=6)
    whole_metrics = whole.train_batch(batch(pairs), seed=0).meta_info[METRICS]
    split = engine(reward_model(reward_model_dir), **micro)
    split_metrics = split.train_batch(batch(pairs), seed=0).meta_info[METRICS]
    for key in (RM_LOSS, "rm/accuracy", "rm/chosen_score", "rm/score_margin"):
        # fp32 sums of other shapes: on some CPUs (AVX-512 kernels) a few 1e-6 apart, relatively
        assert split_metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5, abs=1e-6), key
    for (name, weight), (_, expected) in zip(split.model.named_parameters(), whole.model.named_parameters()):
        torch.testing.assert_close(weight, expected, atol=2e-7, rtol=0, msg=name)


def test_the_score_is_read_at_the_last_token_that_is_not_the_pad_token():
    """transformers' rule for a sequence classifier: trailing pad ids (real or padding) are skipped."""
    ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 0, 0, 0], [3, 4, 5, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    assert score_columns(ids, mask, pad_token_id=0).tolist() == [3, 1, 2]


def test_a_lora_reward_model_trains_its_head_whole_and_scores_packed_as_padded(reward_model_dir, pairs):
    lora = LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"], target_parameters=[])
    model = apply_lora(reward_model(reward_model_dir), lora)
    head = [name for name, p in model.named_parameters() if p.requires_grad and ".score." in name]
    assert head, "the score head trains whole under LoRA"
    rm = engine(model)
    before = rm.evaluate(batch(pairs)).batch[SEQUENCE_SCORE]
    padded = engine(copy.deepcopy(model), use_remove_padding=False).evaluate(batch(pairs)).batch[SEQUENCE_SCORE]
    torch.testing.assert_close(before, padded, atol=1e-5, rtol=1e-5)
    metrics = rm.train_batch(batch(pairs), seed=0).meta_info[METRICS]
    assert metrics["rm/grad_norm"] > 0
    assert not torch.allclose(rm.evaluate(batch(pairs)).batch[SEQUENCE_SCORE], before)


def test_rows_hold_the_whole_scored_text(reward_model_dir, pairs):
    tokenizer = load_tokenizer(reward_model_dir)
    data = batch(pairs)
    for i, (row, side) in enumerate((row, side) for row in PAIRS for side in ("chosen", "rejected")):
        messages = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": row[side]}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        real = data.batch[INPUT_IDS][i][data.batch[ATTENTION_MASK][i].bool()]
        assert real.tolist() == ids
