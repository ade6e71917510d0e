"""GRPO with the 3D-HybridEngine's layouts against plain data parallelism: tiny-llama, fp32, 2 ranks.

t=1: each rank trains on its rows (FSDP2) and generates its prompts from a whole copy. t=2, tg=1: the
actor's layers are split over the 2 ranks in training; each rank still generates its own prompts,
from a whole copy gathered within the TP group. t=2, tg=2: the 2 ranks also generate together, each
holding half of every layer and of the KV cache, and the switch moves nothing (the training shard is
the generation shard). Samples are seeded per generation group, so t=2, tg=2 (one group) draws what
one rank alone draws, and t=2, tg=1 what t=1 on 2 ranks draws; in fp32 each pair agrees on every loss
to rounding. The runs share the module's Ray cluster; the data-parallel run (t=1) is also the on-policy update's."""

from pathlib import Path

import pytest
from test_train_e2e import assert_all_finite, short_run

pytestmark = pytest.mark.slow

FP32 = [
    "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
    "actor_rollout_ref.rollout.dtype=fp32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.val_before_train=false",
    "trainer.save_freq=2",
]
# name: (ranks, t, tg)
LAYOUTS = {"one_rank": (1, 1, 1), "t1": (2, 1, 1), "t2_tg1": (2, 2, 1), "t2_tg2": (2, 2, 2)}
SAME_SAMPLES = {"t2_tg1": "t1", "t2_tg2": "one_rank"}


# LoRA: the adapters split with their layers in training, the switch gathers (t2_tg1) or keeps (t2_tg2) their
# slices like the layers', and the engine serves them split over tg; a KL loss with the adapters off as reference
LORA = [
    "actor_rollout_ref.model.lora.rank=4",
    "actor_rollout_ref.model.lora.alpha=8",
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "actor_rollout_ref.actor.use_kl_loss=true",
]


@pytest.fixture(scope="module")
def layout_runs(local_ray, arithmetic_files, tmp_path_factory):
    """``get(model, name)``: the records and run directory of the GRPO run in layout ``name``, made once."""
    made = {}

    def get(model: str, name: str) -> tuple[list[dict], Path]:
        if (model, name) not in made:
            ranks, t, tg = LAYOUTS[name]
            run_dir = tmp_path_factory.mktemp(f"{model}_{name}")
            records = short_run(
                arithmetic_files,
                run_dir,
                *FP32,
                *(LORA if model == "lora" else []),
                f"trainer.n_workers_per_node={ranks}",
                f"actor_rollout_ref.actor.tensor_model_parallel_size={t}",
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tg}",
            )
            made[model, name] = records, run_dir
        return made[model, name]

    return get


@pytest.mark.parametrize("model", ["full", "lora"])
def test_grpo_in_the_hybrid_engine_layouts_matches_data_parallel(layout_runs, model):
    runs = {name: layout_runs(model, name)[0] for name in LAYOUTS}
    for name, reference in SAME_SAMPLES.items():
        assert_all_finite(runs[name])
        for layout, data_parallel in zip(runs[name], runs[reference]):
            assert layout["response_length/mean"] == data_parallel["response_length/mean"], name  # same samples
            keys = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/log_prob_diff_mean")
            for key in keys + (("actor/kl_loss",) if model == "lora" else ()):
                # another reduction order (the layer's halves summed instead of the rows'): a small tolerance
                assert layout[key] == pytest.approx(data_parallel[key], rel=1e-4, abs=1e-6), (name, key)
    for step in range(2):
        whole, split = runs["t2_tg1"][step], runs["t2_tg2"][step]
        for record in (whole, split, runs["t1"][step]):
            assert record["switch/received_mb"] == pytest.approx(record["switch/predicted_mb"], rel=1e-9)
        assert split["switch/received_mb"] == 0.0  # tg = t, dp = 1: each rank's training shard is its generation shard
        assert whole["switch/received_mb"] > 0.0
        # generation weights: the decoder layers halved, embeddings / norms / head whole
        assert split["switch/generation_weights_mb"] < whole["switch/generation_weights_mb"]
        assert whole["switch/generation_weights_mb"] == pytest.approx(runs["t1"][step]["switch/generation_weights_mb"])
    assert (layout_runs(model, "t2_tg2")[1] / "global_step_2" / "actor").is_dir()  # the 2-D sharded state saves


def test_on_policy_update_supplies_the_old_log_probs_exactly(layout_runs, arithmetic_files, tmp_path):
    """One optimizer step per batch (mini-batch = batch): the update's own pre-step log-probs replace the separate
    pass (fp32: the same run). The data-parallel layout's run reuses them (reuse_update_log_probs, the default)."""
    reused = layout_runs("full", "t1")[0]
    separate = short_run(
        arithmetic_files,
        tmp_path,
        *FP32,
        "trainer.n_workers_per_node=2",
        "actor_rollout_ref.actor.reuse_update_log_probs=false",
    )
    assert "perf/mfu_log_prob" in separate[0] and "perf/mfu_log_prob" not in reused[0]  # no separate pass
    assert len(separate) == len(reused) == 2
    for separate_step, reused_step in zip(separate, reused):
        assert separate_step["response_length/mean"] == reused_step["response_length/mean"]  # the same samples
        for key in [
            "actor/entropy",
            "rollout/log_prob_diff_mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/pg_clipfrac",
        ]:
            assert reused_step[key] == pytest.approx(separate_step[key], rel=1e-4, abs=1e-6), key


def test_ppo_with_a_tensor_parallel_reference_and_critic_matches_data_parallel(local_ray, arithmetic_files, tmp_path):
    """GAE with a critic and the KL loss against the reference: the reference and the critic split their
    layers over the 2 ranks (their own tensor_model_parallel_size) and agree with t=1 to rounding."""
    ppo = [
        *FP32,
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.ref.fsdp.param_dtype=fp32",
        "critic.fsdp.param_dtype=fp32",
        "critic.ppo_mini_batch_size=4",
    ]
    runs = {
        t: short_run(
            arithmetic_files,
            tmp_path / f"t{t}",
            *ppo,
            f"actor_rollout_ref.ref.tensor_model_parallel_size={t}",
            f"critic.tensor_model_parallel_size={t}",
        )
        for t in (1, 2)
    }
    assert_all_finite(runs[2])
    for split, data_parallel in zip(runs[2], runs[1]):
        assert split["response_length/mean"] == data_parallel["response_length/mean"]  # same samples
        for key in ("actor/kl_loss", "actor/pg_loss", "critic/vf_loss", "critic/grad_norm", "critic/values/mean"):
            assert split[key] == pytest.approx(data_parallel[key], rel=1e-4, abs=1e-6), key
    assert (tmp_path / "t2" / "global_step_2" / "critic").is_dir()  # the critic's 2-D sharded state saves
