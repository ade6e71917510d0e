"""A new role is one part and one registration: the run's config gains its section, the run plan needs it, places it,
lays it out with its own tensor-parallel key and builds its worker's spec; the step runs its scoring pass; the
planner costs its stage. The role made up here is a judge: a second frozen policy scoring every sampled token, wanted
when its section enables it. Nothing outside this file is changed for it."""

from dataclasses import dataclass

import pytest

from hybridflow.controller import Role, RoleSpec
from hybridflow.planner.cluster import cluster_preset
from hybridflow.planner.cost import phases, stage_seconds
from hybridflow.planner.workload import workload_from_config
from hybridflow.trainer.commands.train import role_specs
from hybridflow.trainer.setup.config import (
    PART_SECTIONS,
    ConfigError,
    config_sections,
    load_config,
    register_section,
    to_yaml,
)
from hybridflow.trainer.setup.role_parts import ROLE_PARTS, RolePart, register_role_part
from hybridflow.trainer.setup.roles import RoleGroups
from hybridflow.trainer.setup.run_plan import make_run_plan
from hybridflow.validation import InvalidSetting
from hybridflow.workers import RefPolicyWorker

KL_LOSS = ["judge.enable=true"]  # the judge's own switch


@dataclass(kw_only=True)
class JudgeConfig:
    """The judge: a second frozen policy that scores every sampled token."""

    enable: bool = False  # score with the judge
    tensor_model_parallel_size: int = 1  # ranks that split each decoder layer
    temperature: float = 1.0  # the temperature its log-probs are taken at

    def __post_init__(self):
        if self.temperature <= 0:
            raise InvalidSetting("temperature", f"must be positive, got {self.temperature}", "e.g. 1.0")


def judge_worker(config, plan, total_steps) -> RoleSpec:
    judge = Role("judge")
    kwargs = dict(config=config.actor_rollout_ref, model_path=plan.paths.actor_model, layout=plan.layouts[judge])
    return RoleSpec(RefPolicyWorker, kwargs=kwargs | dict(seed=config.trainer.seed))


@pytest.fixture
def judge(monkeypatch):
    """The judge's role and part, registered for one test (the registries are restored after it)."""
    monkeypatch.setattr(Role, "_known", dict(Role._known))
    role = Role.register("judge")
    register_role_part(  # the registry line
        RolePart(
            role=role,
            needed=lambda config, estimator: config.judge.enable,
            pool="critic",
            worker=judge_worker,
            model=lambda config, paths: (config.actor_rollout_ref.model.path, paths.actor_model),
            section="judge",
            config=JudgeConfig,
            scores="compute_ref_log_prob",
            stages=("judge",),
        )
    )
    yield role
    del ROLE_PARTS[role], PART_SECTIONS["judge"]


def test_its_section_is_read_checked_shown_and_kept_as_the_others(judge, tmp_path):
    assert load_config([]).judge == JudgeConfig()
    config = load_config(["judge.enable=true", "judge.temperature=0.5"])
    assert config.judge == JudgeConfig(enable=True, temperature=0.5)
    with pytest.raises(ConfigError, match=r"judge\.temprature.: no such key\n.*did you mean judge\.temperature"):
        load_config(["judge.temprature=0.5"])
    with pytest.raises(ConfigError, match=r"'judge\.temperature': must be positive, got -1.0"):
        load_config(["judge.temperature=-1"])
    with pytest.raises(ConfigError, match=r"judge\.enable"):
        load_config(["judge.enable=maybe"])
    assert ("judge", "The judge: a second frozen policy that scores every sampled token.") in config_sections()
    saved = tmp_path / "config.yaml"  # as the run directory keeps it: it reads back as the same config
    saved.write_text(to_yaml(config))
    assert load_config(config_file=saved).judge == config.judge
    with pytest.raises(ValueError, match="already has a section 'judge'"):
        register_section("judge", JudgeConfig)
    with pytest.raises(ValueError, match="already has a section 'critic'"):
        register_section("critic", JudgeConfig)


def test_the_plan_needs_places_and_lays_out_a_made_up_role(judge):
    assert judge not in make_run_plan(load_config([])).roles
    plan = make_run_plan(load_config([*KL_LOSS, "trainer.placement=group_colocate", "trainer.n_workers_per_node=2"]))
    assert plan.roles[-1] is judge and plan.placement.role_pool[judge] == "critic"
    assert plan.layouts[judge].dp == 2 and plan.layouts[judge].t == 1
    split = make_run_plan(load_config([*KL_LOSS, "trainer.n_workers_per_node=2", "judge.tensor_model_parallel_size=2"]))
    assert split.layouts[judge].t == 2 and split.layouts[judge].dp == 1
    separate = make_run_plan(load_config([*KL_LOSS, "trainer.placement=separate", "trainer.n_workers_per_node=1"]))
    assert separate.placement.role_pool[judge] == "judge" and separate.placement.pools["judge"] == [1]
    custom = [*KL_LOSS, "trainer.placement=custom", "trainer.resource_pool_spec.main=[2]"]
    custom += ["trainer.role_pool.actor_rollout=main", "trainer.role_pool.ref=main"]
    with pytest.raises(ConfigError, match=r"trainer.role_pool.*judge have no pool"):
        make_run_plan(load_config(custom))
    assert make_run_plan(load_config([*custom, "trainer.role_pool.judge=main"])).placement.role_pool[judge] == "main"


def test_its_worker_and_scoring_pass_come_from_its_part(judge):
    config = load_config([*KL_LOSS, "trainer.n_workers_per_node=2"])
    plan = make_run_plan(config)
    spec = role_specs(config, plan, total_steps=3)[judge]
    assert spec.cls is RefPolicyWorker and spec.kwargs["layout"] == plan.layouts[judge]
    groups = RoleGroups.from_roles({Role.ActorRollout: "actor group", judge: "judge group"}, plan.placement.role_pool)
    assert ("judge group", "compute_ref_log_prob") in groups.scoring_passes()


def test_the_planner_costs_its_stage_beside_the_other_scoring_passes(judge):
    config = load_config([*KL_LOSS, "trainer.n_workers_per_node=2"])
    assert "judge" in phases()[1]
    workload = workload_from_config(config)
    assert judge in workload.models
    layout = make_run_plan(config).layouts[judge]
    seconds = stage_seconds(judge, workload.models[judge], layout, workload, cluster_preset("h100-80g"))
    assert list(seconds) == ["judge"] and seconds["judge"] > 0


def test_a_role_has_one_part_and_an_unknown_role_is_named():
    with pytest.raises(ValueError, match="role teacher already has a part"):
        register_role_part(ROLE_PARTS[Role.Teacher])
    with pytest.raises(ValueError, match="unknown role 'judge'"):
        Role("judge")
