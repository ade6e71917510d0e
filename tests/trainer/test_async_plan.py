"""The rollout role of asynchronous modes in the run plan, without Ray: which roles, which pools, which
layouts, and the configs that cannot work (each a ConfigError naming its key)."""

import pytest

from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.trainer.setup.check_config import _check_async
from hybridflow.trainer.setup.config import ConfigError, load_config
from hybridflow.trainer.setup.run_plan import make_run_plan

ONE_STEP_OFF = ["trainer.async_training.mode=one_step_off", "algorithm.rollout_correction.rollout_is=token"]


def plan_of(*overrides: str):
    return make_run_plan(load_config([*ONE_STEP_OFF, *overrides]))


def test_sync_needs_no_rollout_role_and_the_actor_generates():
    plan = make_run_plan(load_config(["trainer.placement=group_colocate"]))
    assert Role.Rollout not in plan.roles
    assert plan.generation_layout == plan.actor_layout == LayoutShape(dp=2, t=1, tg=1)


def test_group_colocate_puts_the_rollout_role_on_a_pool_of_its_own():
    plan = plan_of("trainer.placement=group_colocate", "trainer.n_workers_per_node=1")
    assert plan.roles == (Role.ActorRollout, Role.Rollout)
    assert plan.placement.pools == {"actor": [1], "rollout": [1]}
    assert plan.generation_layout == plan.layouts[Role.Rollout] == LayoutShape(dp=1, t=1, tg=1)


def test_separate_gives_the_rollout_role_its_pool_beside_the_others():
    plan = plan_of("trainer.placement=separate", "trainer.n_workers_per_node=1", "algorithm.adv_estimator=gae")
    assert plan.placement.pools == {"actor_rollout": [1], "critic": [1], "rollout": [1]}


def test_rollout_layout_groups_its_ranks_by_tg_and_the_actor_only_trains():
    plan = plan_of(
        "trainer.placement=custom",
        "trainer.resource_pool_spec.train=[2]",
        "trainer.resource_pool_spec.gen=[4]",
        "trainer.role_pool.actor_rollout=train",
        "trainer.role_pool.rollout=gen",
        "actor_rollout_ref.actor.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.model.path=tiny-qwen2",
    )
    assert plan.layouts[Role.Rollout] == LayoutShape(dp=2, t=2, tg=2)  # two replicas of tg=2
    assert plan.actor_layout == LayoutShape(dp=1, t=2, tg=1)


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["trainer.placement=all_colocate"], "trainer.placement", "both are on pool 'global'"),
        (
            [
                "trainer.placement=custom",
                "trainer.resource_pool_spec.both=[2]",
                "trainer.role_pool.actor_rollout=both",
                "trainer.role_pool.rollout=both",
            ],
            "trainer.role_pool.rollout",
            "both are on pool 'both'",
        ),
        (
            ["trainer.placement=custom", "trainer.resource_pool_spec.a=[1]", "trainer.role_pool.actor_rollout=a"],
            "trainer.role_pool",
            "rollout have no pool",
        ),
        (
            [
                "trainer.placement=separate",
                "trainer.n_workers_per_node=1",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            ],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "does not divide the 1 ranks of pool 'rollout'",
        ),
    ],
)
def test_placements_that_cannot_overlap_or_fit_are_refused(overrides, key, says):
    with pytest.raises(ConfigError) as error:
        plan_of(*overrides)
    assert error.value.key == key and says in str(error.value)


def test_one_step_off_needs_a_loss_that_corrects_for_the_lag():
    uncorrected = load_config(["trainer.async_training.mode=one_step_off", "trainer.placement=group_colocate"])
    with pytest.raises(ConfigError) as error:
        _check_async(uncorrected)
    assert error.value.key == "trainer.async_training.mode" and "rollout_is=token" in str(error.value)
    _check_async(load_config([*ONE_STEP_OFF]))
    _check_async(
        load_config(
            ["trainer.async_training.mode=one_step_off", "actor_rollout_ref.rollout.old_log_prob_source=rollout"]
        )
    )


def test_fully_async_needs_a_correction_unless_it_has_no_staleness():
    base = ["trainer.async_training.mode=fully_async", "trainer.placement=group_colocate"]
    with pytest.raises(ConfigError) as error:
        _check_async(load_config([*base, "trainer.async_training.max_staleness=2"]))
    assert error.value.key == "trainer.async_training.mode" and "up to 2 policy versions" in str(error.value)
    _check_async(load_config([*base, "trainer.async_training.max_staleness=0"]))  # on policy: nothing to correct
    _check_async(load_config([*base, "algorithm.rollout_correction.rollout_is=token"]))


def test_a_push_schedule_that_would_starve_the_trainer_is_refused():
    with pytest.raises(ConfigError) as error:
        load_config(["trainer.async_training.max_staleness=1", "trainer.async_training.weight_push_every=3"])
    assert error.value.key == "trainer.async_training.weight_push_every" and "wait forever" in str(error.value)
    load_config(["trainer.async_training.max_staleness=2", "trainer.async_training.weight_push_every=3"])


def test_an_unknown_staleness_policy_is_refused():
    with pytest.raises(ConfigError) as error:
        load_config(["trainer.async_training.staleness_policy=skip"])
    assert error.value.key == "trainer.async_training.staleness_policy" and "drop" in str(error.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("trainer.async_training.mode=one_step_off", "only fully_async"),
        ("actor_rollout_ref.rollout.name=hf", "cannot pause a call"),
        ("actor_rollout_ref.rollout.multi_turn.enable=true", "multi-turn"),
        ("algorithm.filter_groups.enable=true", "dynamic sampling"),
        ("algorithm.adv_estimator=remax", "greedy baseline"),
    ],
)
def test_partial_rollout_is_refused_where_a_call_cannot_be_cut_short(change, says):
    base = [
        "trainer.async_training.mode=fully_async",
        "trainer.async_training.partial_rollout=true",
        "algorithm.rollout_correction.rollout_is=token",
    ]
    _check_async(load_config(base))  # native, single-turn: fine
    with pytest.raises(ConfigError) as error:
        _check_async(load_config([*base, change]))
    assert error.value.key == "trainer.async_training.partial_rollout" and says in str(error.value)
