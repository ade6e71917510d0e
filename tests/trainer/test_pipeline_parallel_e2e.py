"""Whole GRPO and PPO runs (fp32) on 2 ranks: with the actor, its reference and (PPO, GAE) the critic split into 2
pipeline stages (1F1B, one data-parallel rank) every metric of each step equals the run with the rows split over 2
data-parallel ranks (pp = 1), up to float rounding; and the checkpoint of step 2 written at pp = 2 resumes at pp = 1 to
the metrics of steps 3 and 4. One step off, the actor in 2 stages sends its weights to a rollout pool of its own, and
the run equals the one with the actor over 2 data-parallel ranks. The kill -9 resume at pp = 2 is
tests/trainer/test_kill_and_resume.py's "pipeline" mode."""

import pytest
from layout_runs import grpo_equals_data_parallel, ppo_equals_data_parallel_and_resumes_there
from test_kill_and_resume import MODES

from hybridflow.models import resolve_model_path

pytestmark = pytest.mark.slow

PP_KEYS = (
    "actor_rollout_ref.actor.pipeline_model_parallel_size",
    "actor_rollout_ref.ref.pipeline_model_parallel_size",
    "critic.pipeline_model_parallel_size",
)
PP_1 = [f"{key}=1" for key in PP_KEYS]


def test_grpo_at_pp_2_equals_pp_1(local_ray, tmp_path):
    grpo_equals_data_parallel(tmp_path, "pipeline", PP_1)


def test_grpo_at_pp_2_with_ulysses_equals_dp_4(local_ray, tmp_path):
    """4 ranks: the actor and its reference in 2 stages whose 2 sp ranks each split every micro-batch's tokens (one
    data-parallel rank), against 4 data-parallel ranks; every rank generates (4 generation groups in both)."""
    sp_keys = [f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size" for role in ("actor", "ref")]
    both = ("trainer.n_workers_per_node=4", *(f"{key}=2" for key in sp_keys))
    grpo_equals_data_parallel(tmp_path, "pipeline", [*PP_1, *(f"{key}=1" for key in sp_keys)], both)


def test_ppo_at_pp_2_with_ulysses_equals_dp_4_and_resumes_there(local_ray, tmp_path):
    """PPO with GAE on 4 ranks: the actor, its reference and the critic in 2 stages of 2 sp ranks, against 4
    data-parallel ranks; the checkpoint of step 2 resumes at dp 4."""
    sp_keys = [
        *(f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size" for role in ("actor", "ref")),
        "critic.ulysses_sequence_parallel_size",
    ]
    both = ("trainer.n_workers_per_node=4", *(f"{key}=2" for key in sp_keys))
    ppo_equals_data_parallel_and_resumes_there(tmp_path, "pipeline", [*PP_1, *(f"{key}=1" for key in sp_keys)], both)


def test_grpo_with_interleaved_stages_equals_pp_1(local_ray, tmp_path):
    """4 stages of a 4-layer tiny-llama on 2 ranks (interleaved 1F1B), the actor's and the reference's."""
    path = resolve_model_path("tiny-llama", num_hidden_layers=4)
    virtual = [f"{key.replace('pipeline', 'virtual_pipeline')}={{}}" for key in PP_KEYS[:2]]
    both = (f"actor_rollout_ref.model.path={path}",)
    interleaved = (*both, *(entry.format(2) for entry in virtual))
    grpo_equals_data_parallel(tmp_path, "pipeline", [*PP_1, *(entry.format(1) for entry in virtual)], interleaved)


# the entropy bonus moves the adapters where every sample of a group scores alike (no advantage to follow)
LORA = (
    "actor_rollout_ref.model.lora.rank=4",
    "actor_rollout_ref.model.lora.alpha=8",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_generating_in_2_stages_equals_one_process(local_ray, tmp_path, lora):
    """The actor in 2 training stages generates in 2 stages too (rollout.pipeline_model_parallel_size=2): each rank
    holds one layer and its cache, and the 2 ranks make one generation group, sampling as one process does; the run
    equals the one on a single process in every metric. With LoRA each stage serves its own layers' adapters."""
    generation_stages = "actor_rollout_ref.rollout.pipeline_model_parallel_size"
    one_process = [*PP_1, "trainer.n_workers_per_node=1", f"{generation_stages}=1"]
    switch = ("switch/received_mb", "switch/predicted_mb", "switch/generation_weights_mb", "switch/training_params_mb")
    both = (f"{generation_stages}=2", *(LORA if lora else ()))
    runs = grpo_equals_data_parallel(tmp_path, "pipeline", one_process, both, switch)
    # each rank holds half the layers and receives the other stage's embedding (here the tied head, and the norm)
    split, whole = runs["split"][1], runs["baseline"][1]
    assert split["switch/received_mb"] == split["switch/predicted_mb"] > 0 == whole["switch/received_mb"]
    assert split["switch/generation_weights_mb"] < whole["switch/generation_weights_mb"]


def test_ppo_at_pp_2_equals_pp_1_and_its_checkpoint_resumes_at_pp_1(local_ray, tmp_path):
    ppo_equals_data_parallel_and_resumes_there(tmp_path, "pipeline", PP_1)


def test_one_step_off_with_the_actor_in_stages_equals_pp_1(local_ray, tmp_path):
    """The actor (2 ranks: 2 stages, or 2 data-parallel ranks) sends its weights to the rollout's pool (1 rank) after
    each update, each weight from the rank of its stage; the reference on the actor's pool, unsplit."""
    one_step_off = [
        "trainer.async_training.mode=one_step_off",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=custom",
        "trainer.resource_pool_spec.train=[2]",
        "trainer.resource_pool_spec.generate=[1]",
        "trainer.role_pool.actor_rollout=train",
        "trainer.role_pool.ref=train",
        "trainer.role_pool.rollout=generate",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    runs = grpo_equals_data_parallel(
        tmp_path, "sync", [PP_1[0]], tuple(one_step_off), ("transfer/sent_mb", "transfer/buckets")
    )
    # the busiest actor rank: with stages each sends its own stage's weights, about half of them, and the rollout
    # rank receives a bucket from each
    split, baseline = runs["split"][1]["transfer/sent_mb"], runs["baseline"][1]["transfer/sent_mb"]
    assert 0.4 * baseline < split < 0.6 * baseline
    assert runs["split"][1]["transfer/mb"] == runs["baseline"][1]["transfer/mb"] > 0
    assert runs["split"][1]["transfer/buckets"] == 2 * runs["baseline"][1]["transfer/buckets"]


def test_the_pipeline_mode_splits_every_trained_and_scoring_role():
    assert set(PP_KEYS) <= {entry.partition("=")[0] for entry in MODES["pipeline"]}


def test_grpo_with_the_reward_model_in_stages_equals_pp_1(local_ray, tmp_path, reward_model_dir):
    """The reward model (a random scoring head, so that rewards differ) scores each step's samples in 2 stages on the
    2 ranks, one conversation a micro-batch: every metric, the rewards first, equals its scoring on 2 data-parallel
    ranks."""
    reward_model = (
        "reward_model.enable=true",
        f"reward_model.model.path={reward_model_dir}",
        "reward_model.fsdp.param_dtype=fp32",
        "reward_model.micro_batch_size_per_gpu=1",
        "reward_model.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
    )
    runs = grpo_equals_data_parallel(tmp_path, "sync", ["reward_model.pipeline_model_parallel_size=1"], reward_model)
    assert len({round(runs["split"][step]["critic/score/mean"], 6) for step in (1, 2, 3)}) > 1  # the scores vary


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_a_mixture_s_replayed_routes_and_balancing_loss_reach_each_stage_at_pp_2(local_ray, tmp_path, mode):
    """Tiny Qwen3-MoE in 2 stages with routing replay and its routers' balancing loss: each stage routes the
    micro-batch's tokens through its own layers' recorded experts (R3: the rollout's, so the trainer's log-probs equal
    the rollout's as at pp = 1; R2: those the old-log-prob pass's stages recorded and carried to the last), and every
    metric equals the data-parallel run's (the replay counts summed over the stages; the balancing loss and each
    layer's expert load from the statistics the stages carry)."""
    moe = (
        "actor_rollout_ref.model.path=tiny-qwen3-moe",
        f"actor_rollout_ref.actor.router_replay.mode={mode}",
        "actor_rollout_ref.actor.router_aux_loss_coef=0.5",
        "actor_rollout_ref.actor.reuse_update_log_probs=false",  # the old-log-prob pass replays (R3) or records (R2)
    )
    # the last stage holds a copy of the tied embedding as its head: more bytes a rank than FSDP2 over 2 ranks
    runs = grpo_equals_data_parallel(tmp_path, "pipeline", PP_1, moe, layout_bound=("switch/training_params_mb",))
    for record in runs["split"].values():
        assert mode == "R2" or record["rollout/log_prob_diff_max"] < 1e-4
        assert record["actor/router_aux_loss"] > 0 and "actor/expert_load_max/layer_0" in record
        assert 0 <= record["router_replay/changed_update"] < 0.05  # the update replays, in each stage
        assert mode == "R2" or 0 <= record["router_replay/changed_log_prob"] < 0.05  # R2's pass records, not replays
