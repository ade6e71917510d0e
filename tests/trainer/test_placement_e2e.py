"""PPO with actor, reference, critic and reward model under each placement (tiny-llama, fp32, CPU)."""

import json
import os

import pytest
from test_train_e2e import assert_all_finite, short_run

from hybridflow.controller import Dispatch, Role, RoleSpec, Worker, register
from hybridflow.controller.ray_runtime import ALLOCATOR_ENV
from hybridflow.run_files import TIMELINE_FILE
from hybridflow.trainer.setup.config import load_config
from hybridflow.trainer.setup.placement import Placement, build_groups

pytestmark = pytest.mark.slow

MEASUREMENTS = ("timing_s/", "perf/")  # wall-clock times, throughput, MFU and memory: not reproducible

PPO_ALL_ROLES = [
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "algorithm.use_kl_in_reward=true",
    "reward_model.enable=true",
    "reward_model.model.path=tiny-llama",
    "critic.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
    "actor_rollout_ref.ref.fsdp.param_dtype=fp32",
    "actor_rollout_ref.rollout.dtype=fp32",
    "critic.fsdp.param_dtype=fp32",
    "reward_model.fsdp.param_dtype=fp32",
]


def ppo_run(files, run_dir, *extra: str) -> list[dict]:
    return short_run(files, run_dir, *PPO_ALL_ROLES, "trainer.val_before_train=false", *extra)


def learned(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MEASUREMENTS)} for r in records]


def timeline(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / TIMELINE_FILE).read_text().splitlines()]


def test_the_three_placements_give_the_same_run(local_ray, arithmetic_files, tmp_path):
    runs = {
        placement: ppo_run(
            arithmetic_files, tmp_path / placement, f"trainer.placement={placement}", "trainer.n_workers_per_node=1"
        )
        for placement in ("all_colocate", "group_colocate", "separate")
    }
    reference = learned(runs["all_colocate"])
    assert_all_finite(runs["all_colocate"])
    assert "critic/vf_loss" in reference[1] and "actor/kl_loss" in reference[1]
    for placement in ("group_colocate", "separate"):
        other = learned(runs[placement])
        assert [sorted(r) for r in other] == [sorted(r) for r in reference], placement
        for mine, theirs in zip(other, reference):
            for key, value in theirs.items():  # one rank per pool everywhere: the same reductions, fp32
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (placement, key)
    lanes = {placement: {span["lane"] for span in timeline(tmp_path / placement)} for placement in runs}
    assert lanes["all_colocate"] == {"driver", "global"}
    assert lanes["group_colocate"] == {"driver", "actor", "critic"}
    assert lanes["separate"] == {"driver", "actor_rollout", "ref", "critic", "reward_model"}
    stages = {(s["lane"], s["stage"]) for s in timeline(tmp_path / "separate") if s["step"] == 1}
    for expected in [
        ("actor_rollout", "gen"),
        ("actor_rollout", "old_log_prob"),
        ("ref", "ref"),
        ("critic", "values"),
        ("reward_model", "rm"),
        ("critic", "update_critic"),
        ("actor_rollout", "update_actor"),
        ("driver", "reward"),
        ("driver", "adv"),
    ]:
        assert expected in stages, expected


def overlapping(spans: list[dict], a: tuple[str, str], b: tuple[str, str]) -> bool:
    first = [s for s in spans if (s["lane"], s["stage"]) == a]
    second = [s for s in spans if (s["lane"], s["stage"]) == b]
    return any(x["start"] < y["end"] and y["start"] < x["end"] for x in first for y in second)


def test_pools_of_different_sizes_and_overlapping_stages(local_ray, arithmetic_files, tmp_path):
    """The actor and reference on 2 ranks, the critic and the reward model on 1: the batch collected from one
    pool is split by the other's dispatch; the critic's stages run while the actor's do."""
    pools = [
        "trainer.placement=custom",
        "trainer.resource_pool_spec.train=[2]",
        "trainer.resource_pool_spec.judge=[1]",
        "trainer.role_pool.actor_rollout=train",
        "trainer.role_pool.ref=train",
        "trainer.role_pool.critic=judge",
        "trainer.role_pool.reward_model=judge",
    ]
    records = ppo_run(arithmetic_files, tmp_path / "custom", *pools)
    colocated = ppo_run(arithmetic_files, tmp_path / "colocated", "trainer.n_workers_per_node=2")
    assert_all_finite(records)
    for mine, theirs in zip(learned(records), learned(colocated)):
        assert mine["response_length/mean"] == theirs["response_length/mean"]  # the same samples
        for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "critic/values/mean"):
            # the critic on 1 rank instead of 2 sums its gradients in another order
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    spans = [s for s in timeline(tmp_path / "custom") if s["step"] >= 1]
    assert {(s["lane"], s["rank"]) for s in spans if s["lane"] != "driver"} == {
        ("train", 0),
        ("train", 1),
        ("judge", 0),
    }
    # the critic's values and the reward model's scores run beside the actor's old log-probs and reference pass
    after_generation = [("judge", "values"), ("judge", "rm")], [("train", "old_log_prob"), ("train", "ref")]
    assert any(overlapping(spans, a, b) for a in after_generation[0] for b in after_generation[1])


class EnvironmentReporter(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def environment(self, keys: list[str]) -> dict[str, str | None]:
        return {key: os.environ.get(key) for key in keys}


def test_a_run_s_pools_give_its_workers_its_tuning_settings(local_ray, monkeypatch):
    """build_groups asks Ray for the run's allocator and kernel-cache settings with every pool's actors, on top of
    what the cluster gives (the shared one gives the default run's kernel-cache capacity, 64)."""
    for key in (*ALLOCATOR_ENV, "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(key, raising=False)
    config = load_config(["trainer.cpu_kernel_cache_capacity=5"])
    placement = Placement({"global_pool": [2]}, {Role.ActorRollout: "global_pool"})
    groups = build_groups(config, placement, {Role.ActorRollout: RoleSpec(EnvironmentReporter)})
    try:
        seen = groups.actor_rollout.environment(
            [*ALLOCATOR_ENV, "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"]
        )
    finally:
        groups.release()
    expected = {**ALLOCATOR_ENV, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "5", "LRU_CACHE_CAPACITY": "5"}
    assert seen == [expected, expected]
