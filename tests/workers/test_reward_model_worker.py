"""The reward-model worker scores each conversation as the model does alone, at the response's last token, with its rows
split over 2 data-parallel ranks, each micro-batch's tokens over 2 Ulysses ranks, or its layers into 2 pipeline stages
(1F1B, one micro-batch a conversation)."""

import pytest
import torch

from hybridflow.batch_keys import RAW_PROMPT, RESPONSE_MASK, RESPONSES, RM_SCORES
from hybridflow.controller import RayResourcePool, RayWorkerGroup, RoleSpec
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_reward_model, load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.trainer.setup.config import load_config
from hybridflow.workers import RewardModelWorker
from hybridflow.workers.reward_model import last_token_scores


def test_last_token_scores_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert last_token_scores(torch.tensor([2.0, -1.0, 5.0]), mask).tolist() == [[0, 2.0, 0], [0, 0, -1.0], [0, 0, 0]]


def test_last_token_scores_stay_on_the_mask_s_device():
    """On a GPU rank the batch arrives on the GPU (WorkerHost.call): the token scores are built there, wherever the
    sequence scores were computed; meta tensors stand in for the GPU's here."""
    scores = last_token_scores(torch.tensor([2.0, -1.0]), torch.ones(2, 3, dtype=torch.long, device="meta"))
    assert scores.device.type == "meta" and scores.shape == (2, 3) and scores.dtype == torch.float32


def test_worker_scores_match_scoring_each_conversation_alone(local_ray, reward_model_dir):
    policy_path = str(resolve_model_path("tiny-llama"))
    tokenizer = load_tokenizer(policy_path)
    answers = ["4", "The answer is 12", "no idea at all, sorry"]
    encoded = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    width = max(len(e) for e in encoded) + 2
    responses = torch.full((3, width), tokenizer.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    for i, ids in enumerate(encoded):
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    prompts = [[{"role": "user", "content": q}] for q in ["2+2?", "What is 3 * 4?", "Solve x"]]
    data = DataProto.from_dict({RESPONSES: responses, RESPONSE_MASK: mask}, {RAW_PROMPT: prompts})
    overrides = [
        "reward_model.enable=true",
        f"reward_model.model.path={reward_model_dir}",
        "reward_model.fsdp.param_dtype=fp32",
        "reward_model.micro_batch_size_per_gpu=1",  # 3 micro-batches: a schedule fills both stages
    ]
    config = load_config(overrides).reward_model
    kwargs = {"config": config, "model_path": str(reward_model_dir), "policy_model_path": policy_path, "seed": 0}
    by_layout = {}
    layouts = {
        "dp 2": LayoutShape(dp=2, t=1, tg=1),
        "sp 2": LayoutShape(dp=1, t=1, tg=1, sp=2),
        "pp 2": LayoutShape(dp=1, t=1, tg=1, pp=2),
    }
    for name, layout in layouts.items():
        pool = RayResourcePool([2])
        group = RayWorkerGroup(pool, RoleSpec(RewardModelWorker, kwargs=kwargs | {"layout": layout}))
        by_layout[name] = group.compute_rm_score(data).batch[RM_SCORES]
        pool.release()
    scores = by_layout["dp 2"]
    torch.testing.assert_close(by_layout["sp 2"], scores, atol=1e-5, rtol=1e-5)  # Ulysses: each rank half the tokens
    torch.testing.assert_close(by_layout["pp 2"], scores, atol=1e-5, rtol=1e-5)  # stages: each rank half the layers

    model = load_reward_model(reward_model_dir).eval()
    for i, (messages, answer) in enumerate(zip(prompts, answers)):
        text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            expected = model(**ids).logits[0, 0].item()
        last = len(encoded[i]) - 1
        assert scores[i, last].item() == pytest.approx(expected, abs=1e-4)
        assert scores[i].abs().sum().item() == pytest.approx(abs(expected), abs=1e-4)  # nothing elsewhere
    assert len({round(scores[i].sum().item(), 4) for i in range(3)}) == 3
