"""A reward model's sequence scores through pipeline stages (engine/sequence_scores.py ``pipelined_scores``), fp32,
gloo, Ray ranks: the Bradley-Terry objective's two optimizer steps with the model in 2 stages (1F1B) against one
process. The held-out scores before and after, the loss and the gradient norm of each step are the unsplit model's
(relative 1e-5)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hybridflow.algorithms.objectives import OBJECTIVES
from hybridflow.batch_keys import GLOBAL_STEP, METRICS, SEQUENCE_SCORE
from hybridflow.controller import RayResourcePool, RayWorkerGroup, RoleSpec
from hybridflow.data.io import write_rows
from hybridflow.data.reward_pairs import RewardPairDataset
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_tokenizer
from hybridflow.trainer.setup.rm_config import load_rm_config
from hybridflow.workers.supervised import SupervisedWorker
from tests.data.test_preference_dataset import CONFIG as DATA
from tests.engine.test_preference_engine import PAIRS

FP32 = [
    "engine.fsdp.param_dtype=fp32",
    "engine.use_remove_padding=true",
    "engine.micro_batch_size_per_gpu=2",  # one pair a micro-batch: 3 micro-batches on 2 stages
    "optim.lr=1e-2",
    "optim.eps=1.0",  # AdamW linear in the gradient: the steps compare to rounding
    "optim.weight_decay=0.0",
]


def worker(config, path: str, layout: LayoutShape) -> RoleSpec:
    settings = dict(model=config.model, engine=config.engine, optim=config.optim, model_path=path, layout=layout)
    settings.update(total_training_steps=10, seed=0, objective=OBJECTIVES.get("rm")())
    return RoleSpec(SupervisedWorker, kwargs=settings)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, reward_model_dir):
    path = tmp_path_factory.mktemp("rm-stages") / "pairs.jsonl"
    write_rows(PAIRS, path)
    dataset = RewardPairDataset(path, load_tokenizer(reward_model_dir), DATA)
    return dataset.collate(dataset.pairs)


def scores_and_steps(group: RayWorkerGroup, data) -> tuple[torch.Tensor, list[dict], torch.Tensor]:
    before = group.evaluate(data).batch[SEQUENCE_SCORE]
    steps = []
    for step in (1, 2):
        data.meta_info[GLOBAL_STEP] = step
        steps.append(group.train_batch(data).meta_info[METRICS])
    return before, steps, group.evaluate(data).batch[SEQUENCE_SCORE]


def test_two_stages_score_and_train_as_one_process(local_ray, reward_model_dir, pairs):
    config = load_rm_config([f"model.path={reward_model_dir}", *FP32])
    layouts = {1: LayoutShape(dp=1, t=1, tg=1), 2: LayoutShape(dp=1, t=1, tg=1, pp=2)}
    pools = {size: RayResourcePool([size]) for size in layouts}
    with ThreadPoolExecutor(2) as threads:
        starting = {
            size: threads.submit(RayWorkerGroup, pools[size], worker(config, reward_model_dir, layout))
            for size, layout in layouts.items()
        }
    groups = {size: start.result() for size, start in starting.items()}
    try:
        one = scores_and_steps(groups[1], pairs)
        staged = scores_and_steps(groups[2], pairs)
    finally:
        for pool in pools.values():
            pool.release()
    torch.testing.assert_close(staged[0], one[0], rtol=1e-5, atol=1e-6)
    assert one[0].abs().sum() > 0 and not torch.equal(one[0], one[2])  # scores that tell rows apart, and moved
    for got, want in zip(staged[1], one[1]):
        for key in ("rm/loss", "rm/grad_norm", "rm/accuracy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
    torch.testing.assert_close(staged[2], one[2], rtol=1e-5, atol=1e-6)
