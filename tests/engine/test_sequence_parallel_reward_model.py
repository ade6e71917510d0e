"""A mixture-of-experts reward model trained under Ulysses (sp = 2), fp32, gloo, Ray ranks: the Bradley-Terry
objective's two optimizer steps with the routers' balancing loss (weight 0.5, the model config's), each rank's routers
seeing its slice of every micro-batch and the slices' statistics summed over the pair, against one process running
the whole micro-batches. The held-out scores before and after, the loss, the balancing loss, each layer's busiest
expert and the gradient norm of each step are one process's (relative 1e-5)."""

import pytest
import torch

from hybridflow.controller import RayResourcePool, RayWorkerGroup
from hybridflow.data.io import write_rows
from hybridflow.data.reward_pairs import RewardPairDataset
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_reward_model, load_tokenizer
from hybridflow.trainer.setup.rm_config import load_rm_config
from tests.data.test_preference_dataset import CONFIG as DATA
from tests.engine.test_pipeline_reward_model import FP32, scores_and_steps, worker
from tests.engine.test_preference_engine import PAIRS

pytestmark = pytest.mark.slow  # Ray worker groups of 1 and 2 ranks: the fast tier's time


@pytest.fixture(scope="module")
def mixture_reward_model_dir(tmp_path_factory):
    """tiny-qwen3-moe as a reward model with a random scoring head, its routers' balancing loss weighing 0.5."""
    directory = tmp_path_factory.mktemp("rm-moe")
    torch.manual_seed(1)
    model = load_reward_model("tiny-qwen3-moe")
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.config.router_aux_loss_coef = 0.5
    model.save_pretrained(directory)
    load_tokenizer("tiny-qwen3-moe").save_pretrained(directory)
    return directory


def test_a_mixture_reward_model_at_sp_2_trains_as_one_process(local_ray, mixture_reward_model_dir, tmp_path):
    path = str(mixture_reward_model_dir)
    write_rows(PAIRS, tmp_path / "pairs.jsonl")
    dataset = RewardPairDataset(tmp_path / "pairs.jsonl", load_tokenizer(path), DATA)
    pairs = dataset.collate(dataset.pairs)
    runs = {}
    for sp in (1, 2):
        config = load_rm_config([f"model.path={path}", *FP32, f"engine.ulysses_sequence_parallel_size={sp}"])
        pool = RayResourcePool([sp])
        try:
            group = RayWorkerGroup(pool, worker(config, path, LayoutShape(dp=1, t=1, tg=1, sp=sp)))
            runs[sp] = scores_and_steps(group, pairs.select(deepcopy=True))
        finally:
            pool.release()
    one, split = runs[1], runs[2]
    torch.testing.assert_close(split[0], one[0], rtol=1e-5, atol=1e-6)
    balancing = [key for key in one[1][0] if "router_aux_loss" in key or "expert_load_max" in key]
    assert len(balancing) == 3 and one[1][0]["rm/router_aux_loss"] > 1  # the loss and 2 layers' loads
    for got, want in zip(split[1], one[1]):
        for key in ("rm/loss", "rm/grad_norm", *balancing):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
    assert not torch.equal(one[0], one[2])  # the steps moved the scores
    torch.testing.assert_close(split[2], one[2], rtol=1e-5, atol=1e-6)
