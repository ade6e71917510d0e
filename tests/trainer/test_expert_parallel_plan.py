"""The expert-parallel size in the run's config and plan: read (verl's Megatron spelling too), laid out for the
critic, and refused before anything starts where it cannot run, naming the key and the fix."""

import pytest

from hybridflow.controller import Role
from hybridflow.models.tiny import tiny_model_config
from hybridflow.trainer.setup.check_config import check_config
from hybridflow.trainer.setup.config import ConfigError, load_config
from hybridflow.trainer.setup.run_plan import make_run_plan

MOE_CRITIC = ["algorithm.adv_estimator=gae", "critic.model.path=tiny-qwen3-moe", "trainer.n_workers_per_node=2"]
KEY = "critic.expert_model_parallel_size"


def test_the_actor_and_the_critic_split_their_experts_over_their_data_parallel_ranks():
    plan = make_run_plan(load_config([*MOE_CRITIC, f"{KEY}=2"]))
    assert plan.layouts[Role.Critic].ep == 2 and plan.layouts[Role.Critic].dp == 2
    assert plan.layouts[Role.ActorRollout].ep == 1
    actor = ["actor_rollout_ref.model.path=tiny-mixtral", "actor_rollout_ref.actor.expert_model_parallel_size=2"]
    assert make_run_plan(load_config([*MOE_CRITIC, *actor])).layouts[Role.ActorRollout].ep == 2
    spelled = load_config([*MOE_CRITIC, "critic.megatron.expert_model_parallel_size=2"])
    assert spelled.critic.expert_model_parallel_size == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["critic.model.path=tiny-llama", f"{KEY}=2"], r"2: the model \(llama\) has no mixture-of-experts layers"),
        ([f"{KEY}=4"], "4 does not divide the 2 data-parallel ranks"),
        (["critic.model.path=tiny-qwen3-moe", "trainer.n_workers_per_node=3", f"{KEY}=3"], "3 does not divide"),
        (["actor_rollout_ref.actor.expert_model_parallel_size=2"], r"2: the model \(llama\) has no mixture-of-experts"),
    ],
)
def test_sizes_that_cannot_work_are_refused_with_the_key(overrides, message):
    key = overrides[-1].split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}.*{message}"):
        make_run_plan(load_config([*MOE_CRITIC, *overrides]))


def test_experts_split_over_data_parallel_ranks_alone():
    with pytest.raises(ConfigError, match=rf"{KEY}.*with tensor_model_parallel_size=2.*alone"):
        load_config([*MOE_CRITIC, f"{KEY}=2", "critic.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"critic.router_aux_loss_coef.*must be >= 0"):
        load_config([*MOE_CRITIC, "critic.router_aux_loss_coef=-1"])


def test_the_native_engine_refuses_a_model_it_does_not_run_before_ray(arithmetic_files, tmp_path):
    """A Qwen3-MoE whose first layer keeps a dense MLP (mlp_only_layers): the native engine runs experts in every
    layer."""
    config = tiny_model_config("tiny-qwen3-moe")
    config.mlp_only_layers = [0]
    config.save_pretrained(tmp_path)
    train, test = arithmetic_files
    files = [f"data.train_files=[{train}]", f"data.val_files=[{test}]", f"actor_rollout_ref.model.path={tmp_path}"]
    with pytest.raises(
        ConfigError,
        match=r"(?s)rollout.name.*native cannot generate with .* \(qwen3_moe\).*layers \[0\].*rollout.name=hf",
    ):
        check_config(load_config(files))
    assert check_config(load_config([*files, "actor_rollout_ref.rollout.name=hf"])).layouts[Role.ActorRollout].dp == 2


@pytest.mark.parametrize(
    "key",
    ["actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.actor.tensor_model_parallel_size"],
)
def test_tensor_parallelism_splits_a_mixture_in_training_and_generation(key):
    """Training splits Mixtral's, Qwen3-MoE's and OLMoE's experts between its tp ranks, and generation groups of 2
    split them too; 3 ranks do not split 4 experts."""
    for model in ("tiny-mixtral", "tiny-qwen3-moe", "tiny-olmoe"):
        moe_actor = [f"actor_rollout_ref.model.path={model}", "trainer.n_workers_per_node=2"]
        if key.endswith("rollout.tensor_model_parallel_size"):  # generation groups of 2 need training groups of 2
            moe_actor.append("actor_rollout_ref.actor.tensor_model_parallel_size=2")
        layout = make_run_plan(load_config([*moe_actor, f"{key}=2"])).layouts[Role.ActorRollout]
        assert (layout.dp, layout.t) == (1, 2)
    three = ["actor_rollout_ref.model.path=tiny-mixtral", "trainer.n_workers_per_node=3", f"{key}=3"]
    if key.endswith("rollout.tensor_model_parallel_size"):
        three.append("actor_rollout_ref.actor.tensor_model_parallel_size=3")
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 does not divide .*num_experts"):
        make_run_plan(load_config(three))


REPLAY = "actor_rollout_ref.actor.router_replay.mode"
SEPARATE = ["trainer.placement=separate", "trainer.n_workers_per_node=2"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.model.path=tiny-llama"], "R3: the policy has no experts"),
        (["actor_rollout_ref.rollout.name=vllm"], "rollout.name=vllm does not record them.*rollout.name=hf or native"),
        (
            ["trainer.async_training.mode=fully_async", "trainer.async_training.partial_rollout=true", *SEPARATE],
            "continued across weight pushes",
        ),
    ],
)
def test_routing_replay_that_cannot_work_is_refused_before_ray(arithmetic_files, overrides, message):
    train, test = arithmetic_files
    base = [f"data.train_files=[{train}]", "actor_rollout_ref.model.path=tiny-qwen3-moe"]
    base += [f"{REPLAY}=R3", "algorithm.rollout_correction.rollout_is=token"]
    with pytest.raises(ConfigError, match=rf"(?s){REPLAY}.*{message}"):
        check_config(load_config([*base, *overrides]))
    assert check_config(load_config(base)).layouts[Role.ActorRollout].dp >= 1
    check_config(load_config([*base, "actor_rollout_ref.rollout.multi_turn.enable=true"]))  # agent loops record too
    with pytest.raises(ConfigError, match=rf"{REPLAY}.*'R9'"):
        load_config([*base, f"{REPLAY}=R9"])


def test_r2_needs_an_old_log_prob_pass_of_the_trainers_own(arithmetic_files):
    train, _ = arithmetic_files
    base = [f"data.train_files=[{train}]", "actor_rollout_ref.model.path=tiny-qwen3-moe", f"{REPLAY}=R2"]
    with pytest.raises(ConfigError, match=rf"(?s){REPLAY}.*R2 replays the routes of the trainer's old-log-prob pass"):
        check_config(load_config(base))  # one optimizer step on each batch: no such pass
    own_pass = [*base, "actor_rollout_ref.actor.reuse_update_log_probs=false"]
    assert check_config(load_config(own_pass)).layouts[Role.ActorRollout].dp >= 1
    with pytest.raises(ConfigError, match=rf"(?s){REPLAY}.*R2 replays the routes"):
        check_config(load_config([*own_pass, "actor_rollout_ref.rollout.old_log_prob_source=auto"]))
    ulysses = [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.router_aux_loss_coef=0",
    ]
    assert check_config(load_config([*own_pass, *ulysses])).layouts[Role.ActorRollout].sp == 2  # slices gathered
    r3 = [f"data.train_files=[{train}]", "actor_rollout_ref.model.path=tiny-qwen3-moe", f"{REPLAY}=R3"]
    assert check_config(load_config([*r3, *ulysses])).layouts[Role.ActorRollout].sp == 2  # R3 replays each slice
    stages = [
        "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.router_aux_loss_coef=0",
    ]
    assert check_config(load_config([*r3, *stages])).layouts[Role.ActorRollout].pp == 2  # each stage its layers
    assert check_config(load_config([*own_pass, *stages])).layouts[Role.ActorRollout].pp == 2  # the stages' columns


EXPERT_LORA = "actor_rollout_ref.model.lora.target_parameters"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.model.path=tiny-llama"], r"\['experts.down_proj'\] name no expert weight.*not a mixture"),
        (["actor_rollout_ref.model.lora.dropout=0.1"], "must be 0 with target_parameters"),
    ],
)
def test_adapters_on_experts_are_checked_before_ray(arithmetic_files, overrides, message):
    train, test = arithmetic_files
    args = [
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "actor_rollout_ref.model.path=tiny-mixtral",
        "actor_rollout_ref.model.lora.rank=4",
        f"{EXPERT_LORA}=[experts.down_proj]",
    ]
    assert check_config(load_config(args)).layouts[Role.ActorRollout].dp == 2  # Mixtral's experts take adapters
    split = load_config([*args, "actor_rollout_ref.actor.expert_model_parallel_size=2"])
    assert check_config(split).layouts[Role.ActorRollout].ep == 2  # and keep them with their experts split
    with pytest.raises(ConfigError, match=rf"lora.(target_parameters|dropout).*{message}"):
        check_config(load_config([*args, *overrides]))


def test_a_rollout_pool_splits_a_mixture_s_experts_between_its_generation_ranks():
    """Generation groups of 2 each hold half of the experts (the native engine); training still refuses t = 2."""
    apart = [
        "actor_rollout_ref.model.path=tiny-qwen3-moe",
        "trainer.async_training.mode=one_step_off",
        "trainer.placement=group_colocate",
        "trainer.n_workers_per_node=2",
    ]
    plan = make_run_plan(load_config([*apart, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))
    assert plan.layouts[Role.Rollout].tg == 2 and plan.layouts[Role.ActorRollout].t == 1


def test_a_balancing_loss_runs_in_pipeline_stages_and_under_ulysses(arithmetic_files):
    """The routers' balancing loss pools every MoE layer over a micro-batch: stages carry their layers' statistics to
    the last (engine/pipeline_stages.py), sequence-parallel ranks sum their slices'; both layouts pass the checks with
    a weight above 0, configured or the model's own (the key left null)."""
    train, _ = arithmetic_files
    base = [f"data.train_files=[{train}]", "actor_rollout_ref.model.path=tiny-qwen3-moe"]
    base.append("trainer.n_workers_per_node=2")
    key = "actor_rollout_ref.actor.router_aux_loss_coef"
    staged = [*base, "actor_rollout_ref.actor.pipeline_model_parallel_size=2"]
    for weight in ([], [f"{key}=0.5"]):
        assert check_config(load_config([*staged, *weight])).layouts[Role.ActorRollout].pp == 2
    ulysses = [*base, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", f"{key}=0.5"]
    assert check_config(load_config(ulysses)).layouts[Role.ActorRollout].sp == 2
