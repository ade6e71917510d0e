"""Placement plans from config, without Ray: presets, the explicit form, and its errors."""

import pytest

from hybridflow.controller import Role
from hybridflow.models import resolve_model_path
from hybridflow.trainer.setup.cluster import pool_processes_per_node
from hybridflow.trainer.setup.config import ConfigError, load_config
from hybridflow.trainer.setup.placement import Placement
from hybridflow.trainer.setup.run_plan import make_run_plan

PPO_ALL_ROLES = [
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "reward_model.enable=true",
    "reward_model.model.path=tiny-llama",
]


def plan_of(*overrides: str) -> Placement:
    return make_run_plan(load_config([*PPO_ALL_ROLES, *overrides])).placement


def test_all_colocate_is_one_pool_for_every_role():
    plan = plan_of("trainer.n_workers_per_node=2")
    assert plan.pools == {"global": [2]}
    assert set(plan.role_pool) == set(Role) - {Role.Rollout, Role.Teacher}
    assert set(plan.role_pool.values()) == {"global"}
    assert plan.processes == 2 and plan.world_size(Role.Critic) == 2


def test_group_colocate_pairs_actor_with_ref_and_critic_with_reward_model():
    plan = plan_of("trainer.placement=group_colocate", "trainer.n_workers_per_node=1")
    assert plan.pools == {"actor": [1], "critic": [1]}
    assert plan.roles_on("actor") == [Role.ActorRollout, Role.RefPolicy]
    assert plan.roles_on("critic") == [Role.Critic, Role.RewardModel]


def test_a_teacher_is_placed_like_any_role():
    """On-policy distillation's teacher: with the critic's group in group_colocate, its own pool in separate, the
    pool custom names; its tensor-parallel layout from teacher.tensor_model_parallel_size."""
    teacher = ["teacher.model.path=tiny-llama"]
    grouped = make_run_plan(load_config([*teacher, "trainer.placement=group_colocate", "trainer.n_workers_per_node=1"]))
    assert grouped.roles == (Role.ActorRollout, Role.Teacher)
    assert grouped.placement.pools == {"actor": [1], "critic": [1]} and grouped.placement.roles_on("critic") == [
        Role.Teacher
    ]
    separate = make_run_plan(
        load_config([*teacher, "trainer.placement=separate", "teacher.tensor_model_parallel_size=2"])
    )
    assert separate.placement.pools == {"actor_rollout": [2], "teacher": [2]}
    assert (separate.layouts[Role.Teacher].dp, separate.layouts[Role.Teacher].t) == (1, 2)
    assert not separate.on_policy_update  # the teacher's advantage needs the old log-probs before the update
    custom = make_run_plan(
        load_config(
            [
                *teacher,
                "trainer.placement=custom",
                "trainer.resource_pool_spec.train=[2]",
                "trainer.resource_pool_spec.judge=[1]",
                "trainer.role_pool.actor_rollout=train",
                "trainer.role_pool.teacher=judge",
            ]
        )
    )
    assert custom.placement.role_pool == {Role.ActorRollout: "train", Role.Teacher: "judge"}
    with pytest.raises(ConfigError, match="teacher.tensor_model_parallel_size"):
        make_run_plan(load_config([*teacher, "teacher.tensor_model_parallel_size=3"]))


def test_group_colocate_without_critic_or_reward_model_is_one_pool():
    plan = make_run_plan(load_config(["trainer.placement=group_colocate"])).placement  # GRPO: the actor alone
    assert plan.pools == {"actor": [2]} and list(plan.role_pool) == [Role.ActorRollout]


def test_separate_gives_each_role_its_own_pool():
    plan = plan_of("trainer.placement=separate", "trainer.n_workers_per_node=1")
    assert plan.pools == {"actor_rollout": [1], "ref": [1], "critic": [1], "reward_model": [1]}
    assert plan.processes == 4


def test_custom_pools_of_different_sizes():
    plan = plan_of(
        "trainer.placement=custom",
        "trainer.resource_pool_spec.train=[2]",
        "trainer.resource_pool_spec.small=[1]",
        "trainer.role_pool.actor_rollout=train",
        "trainer.role_pool.ref=train",
        "trainer.role_pool.critic=small",
        "trainer.role_pool.reward_model=small",
    )
    assert plan.world_size(Role.ActorRollout) == 2 and plan.world_size(Role.Critic) == 1
    assert plan.processes == 3


def test_custom_pools_not_used_by_this_run_are_not_started():
    plan = make_run_plan(
        load_config(
            [
                "trainer.placement=custom",
                "trainer.resource_pool_spec.a=[2]",
                "trainer.resource_pool_spec.b=[1]",
                "trainer.role_pool.actor_rollout=a",
                "trainer.role_pool.critic=b",  # GRPO has no critic
            ]
        )
    ).placement
    assert plan.pools == {"a": [2]}


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["trainer.placement=custom"], "trainer.resource_pool_spec", "needs named pools"),
        (
            ["trainer.placement=custom", "trainer.resource_pool_spec.a=[2]", "trainer.role_pool.actor_rollout=a"],
            "trainer.role_pool",
            "ref, critic, reward_model have no pool",
        ),
        (
            ["trainer.placement=custom", "trainer.resource_pool_spec.a=[2]", "trainer.role_pool.actor=a"],
            "trainer.role_pool.actor",
            "no such role",
        ),
        (
            ["trainer.placement=custom", "trainer.resource_pool_spec.a=[0]", "trainer.role_pool.actor_rollout=a"],
            "trainer.resource_pool_spec.a",
            "each >= 1",
        ),
        (
            ["trainer.placement=custom", "trainer.resource_pool_spec.a=[1]", "trainer.role_pool.actor_rollout=b"],
            "trainer.role_pool.actor_rollout",
            "pool 'b' is not in",
        ),
    ],
)
def test_custom_errors_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError, match=words) as error:
        plan_of(*overrides)
    assert error.value.key == key


def test_pools_only_with_custom():
    with pytest.raises(ConfigError, match="read only with placement=custom"):
        load_config(["trainer.resource_pool_spec.a=[1]"])
    with pytest.raises(ConfigError, match="trainer.placement"):
        load_config(["trainer.placement=spread"])


def test_processes_per_node_add_up_over_pools():
    plan = Placement({"a": [2, 2], "b": [1]}, {Role.ActorRollout: "a", Role.Critic: "b"})
    assert pool_processes_per_node(plan) == [3, 2]


def test_sequence_parallel_sizes_become_each_roles_layout():
    """Ulysses keys per section: the actor, the reference, the critic and the teacher each get their own sp; the rows
    split over the rest of the pool's ranks (dp = world / (sp x t)), and the mini-batch is split over dp alone."""
    run_plan = make_run_plan(
        load_config(
            [
                *PPO_ALL_ROLES,
                "trainer.n_workers_per_node=4",
                "teacher.model.path=tiny-llama",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4",
                "critic.ulysses_sequence_parallel_size=4",
                "critic.ppo_mini_batch_size=4",
                "teacher.ulysses_sequence_parallel_size=2",
            ]
        )
    )
    shapes = {role: (layout.dp, layout.sp, layout.t) for role, layout in run_plan.layouts.items()}
    assert shapes[Role.ActorRollout] == (2, 2, 1) and shapes[Role.RefPolicy] == (1, 4, 1)
    assert shapes[Role.Critic] == (1, 4, 1) and shapes[Role.Teacher] == (2, 2, 1)
    assert shapes[Role.RewardModel] == (4, 1, 1)
    assert run_plan.actor_layout.generation_ranks().tolist() == [[0], [1], [2], [3]]  # generation keeps every rank
    n = 4  # rollout.n: 8 prompts x 4 samples over the actor's 2 data-parallel ranks, 4 x 4 over the critic's 1
    assert run_plan.mini_batch_per_rank[Role.ActorRollout] == 8 * n // 2
    assert run_plan.mini_batch_per_rank[Role.Critic] == 4 * n


def test_pipeline_sizes_become_each_roles_layout():
    """Pipeline keys per section (verl's megatron spelling too): stages over pp ranks that hold the same rows, the
    rows split over the rest (dp = world / (pp x t)); the actor generates on every rank (micro-DP over pp)."""
    run_plan = make_run_plan(
        load_config(
            [
                *PPO_ALL_ROLES,
                "trainer.n_workers_per_node=4",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.ref.pipeline_model_parallel_size=2",
                "actor_rollout_ref.ref.tensor_model_parallel_size=2",
                "critic.pipeline_model_parallel_size=2",
                "critic.ppo_micro_batch_size_per_gpu=4",
            ]
        )
    )
    shapes = {role: (layout.dp, layout.pp, layout.t) for role, layout in run_plan.layouts.items()}
    assert shapes[Role.ActorRollout] == (2, 2, 1) and shapes[Role.RefPolicy] == (1, 2, 2)
    assert shapes[Role.Critic] == (2, 2, 1) and shapes[Role.RewardModel] == (4, 1, 1)
    assert run_plan.actor_layout.generation_ranks().tolist() == [[0], [1], [2], [3]]
    assert run_plan.actor_layout.pipeline_ranks().tolist() == [[[0], [1]], [[2], [3]]]


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (  # 2 layers in the tiny model
            [
                "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
                "actor_rollout_ref.actor.virtual_pipeline_model_parallel_size=2",
            ],
            "actor_rollout_ref.actor.virtual_pipeline_model_parallel_size",
            "do not split the model's 2 decoder layers",
        ),
        (
            ["actor_rollout_ref.actor.virtual_pipeline_model_parallel_size=2"],
            "actor_rollout_ref.actor.virtual_pipeline_model_parallel_size",
            "interleave over pipeline ranks",
        ),
        (
            ["critic.pipeline_model_parallel_size=4"],
            "critic.pipeline_model_parallel_size",
            "does not divide the 2 ranks",
        ),
        (
            ["actor_rollout_ref.ref.pipeline_model_parallel_size=2", "actor_rollout_ref.ref.use_remove_padding=false"],
            "actor_rollout_ref.ref.pipeline_model_parallel_size",
            "run on packed rows",
        ),
        (  # a reward model's scores in stages read each row whole on a rank
            [
                "reward_model.pipeline_model_parallel_size=2",
                "reward_model.ulysses_sequence_parallel_size=2",
                "trainer.n_workers_per_node=4",
            ],
            "reward_model.ulysses_sequence_parallel_size",
            "a sequence score's pass in stages",
        ),
        (  # 4 prompts x 2 samples on one data-parallel rank, micro-batches of 8: one, for 2 stages
            [
                "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            ],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            "fewer than the 2 pipeline stages",
        ),
    ],
)
def test_pipeline_errors_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError, match=words) as error:
        plan_of("trainer.n_workers_per_node=2", *overrides)
    assert error.value.key == key


def test_pipeline_stages_and_ulysses_combine():
    """pp 2 x sp 2 over 4 ranks: FSDP2 over the 2 sp ranks of each stage, rank = (sp_index * pp + pp_index); the rows
    whole on every rank (dp = 1), and the actor generating on every rank."""
    run_plan = make_run_plan(
        load_config(
            overrides=[
                "trainer.n_workers_per_node=4",
                "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            ]
        )
    )
    layout = run_plan.actor_layout
    assert (layout.dp, layout.sp, layout.pp, layout.fsdp) == (1, 2, 2, 2)
    assert layout.pipeline_ranks().tolist() == [[[0], [1]], [[2], [3]]]
    assert layout.generation_ranks().tolist() == [[0], [1], [2], [3]]


def test_generation_stages_regroup_the_training_stages():
    """rollout.pipeline_model_parallel_size (pg) with the actor at pp = 2 x dp = 2: each generation group is one
    model's 2 stages; the prompts split over the dp = 2 groups."""
    run_plan = make_run_plan(
        load_config(
            overrides=[
                "trainer.n_workers_per_node=4",
                "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
                "actor_rollout_ref.rollout.pipeline_model_parallel_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            ]
        )
    )
    layout = run_plan.actor_layout
    assert (layout.dp, layout.pp, layout.pg) == (2, 2, 2)
    assert layout.generation_ranks().tolist() == [[[0], [1]], [[2], [3]]]
    assert layout.stage_gather_ranks().tolist() == [[0], [1], [2], [3]]


PG = "actor_rollout_ref.rollout.pipeline_model_parallel_size"


@pytest.mark.parametrize(
    "overrides, words",
    [
        ([f"{PG}=2"], "does not divide actor.pipeline_model_parallel_size=1"),
        (
            [f"{PG}=2", "actor_rollout_ref.actor.pipeline_model_parallel_size=2", "actor_rollout_ref.rollout.name=hf"],
            "needs a backend that generates in pipeline stages",
        ),
        (
            [
                f"{PG}=2",
                "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
                "actor_rollout_ref.actor.virtual_pipeline_model_parallel_size=2",
                "{four_layers}",
            ],
            "not consecutive layers",
        ),
        (
            [
                f"{PG}=2",
                "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
                "trainer.async_training.mode=one_step_off",
                "algorithm.rollout_correction.rollout_is=token",
                "trainer.placement=group_colocate",
            ],
            "a rollout pool of its own generates with every layer",
        ),
        (
            [
                f"{PG}=2",
                "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
                "actor_rollout_ref.rollout.multi_turn.enable=true",
            ],
            "multi-turn rollout generates on one rank",
        ),
    ],
)
def test_generation_stage_errors_name_the_key(overrides, words):
    four_layers = f"actor_rollout_ref.model.path={resolve_model_path('tiny-llama', num_hidden_layers=4)}"
    overrides = [four_layers if o == "{four_layers}" else o for o in overrides]
    with pytest.raises(ConfigError, match=words) as error:
        plan_of("trainer.n_workers_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *overrides)
    assert error.value.key == PG
