"""``hybridflow plan``: the best placement and layouts of a run's config on a cluster, as config overrides.

    hybridflow plan [--config FILE] [--cluster a100-80g|h100-80g|cpu] [--nodes N] [--top K] [--out FILE] key=value ...
    hybridflow plan --calibrate      measure this machine for the cpu preset (planner/calibrate.py)

Prints the best candidates (predicted seconds per phase and step, memory per device) and writes the
best one (``--out``, default plan.yaml) as the ``--config`` file's keys, if one was given, with the plan's
on top: the pools (``trainer.placement=custom``), each role's pool and each model's tensor-, sequence- and
pipeline-parallel sizes. ``hybridflow train --config plan.yaml`` with the same key=value settings runs it.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from hybridflow.controller import Role
from hybridflow.planner.cluster import PRESETS, ClusterSpec, cluster_preset, save_calibration
from hybridflow.planner.cost import phases
from hybridflow.planner.search import Plan, plan_run
from hybridflow.planner.workload import Workload, workload_from_config
from hybridflow.trainer.setup.config import default_config
from hybridflow.trainer.setup.modes import ONE_STEP_OFF, SYNC, training_mode
from hybridflow.trainer.setup.role_parts import (
    EXPERT_PARALLEL,
    PIPELINE_PARALLEL,
    ROLE_PARTS,
    SEQUENCE_PARALLEL,
    TENSOR_PARALLEL,
    VIRTUAL_PIPELINE,
)
from hybridflow.trainer.setup.run_plan import PG_KEY, TG_KEY
from hybridflow.validation import UserError

FLAGS = {"--config": "FILE", "--cluster": "NAME", "--nodes": "N", "--top": "K", "--out": "FILE"}
USAGE = __doc__


def plan_overrides(plan: Plan, cluster: ClusterSpec, apart_mode: str = ONE_STEP_OFF) -> dict:
    """The plan as nested config keys: pools per node, each role's pool, each model's layout; a plan with the
    rollout apart keeps ``apart_mode`` (the config's asynchronous mode, one_step_off or fully_async)."""
    pools, role_pool = {}, {}
    layouts: dict = {}  # each role's tensor-, sequence- and pipeline-parallel sizes under its section's keys, nested
    defaults = default_config()
    for device_set in plan.sets:
        name = device_set.roles[0].value
        per_node = min(device_set.devices, cluster.devices_per_node)
        pools[name] = [per_node] * (device_set.devices // per_node)
        for role, layout in device_set.layouts.items():
            role_pool[role.value] = name
            part = ROLE_PARTS[role]
            sizes = {TENSOR_PARALLEL: layout.t, SEQUENCE_PARALLEL: layout.sp, PIPELINE_PARALLEL: layout.pp}
            sizes[EXPERT_PARALLEL] = layout.ep
            sizes[VIRTUAL_PIPELINE] = 1  # the planner costs 1F1B, one stage per pipeline rank
            for size_name, size in sizes.items():  # those its section has (the reward model's: sp alone)
                if part.section and hasattr(part.settings(defaults), size_name):
                    _set(layouts, part.key(size_name), size)
            if role is Role.Rollout or (role is Role.ActorRollout and not plan.overlapped):
                _set(layouts, TG_KEY, layout.tg)
                _set(layouts, PG_KEY, layout.pg)
    overrides: dict = {
        "trainer": {
            "placement": "custom",
            "nnodes": cluster.nodes,
            "n_workers_per_node": cluster.devices_per_node,
            "device": "cpu" if cluster.name == "cpu" else "cuda",
            "resource_pool_spec": pools,
            "role_pool": role_pool,
            "async_training": {"mode": apart_mode if plan.overlapped else SYNC},
        },
    }
    return {**overrides, **layouts}


def _set(tree: dict, key: str, value: int) -> None:
    """``tree[a][b][c] = value`` for the key "a.b.c"."""
    *sections, last = key.split(".")
    for section in sections:
        tree = tree.setdefault(section, {})
    tree[last] = value


def mode_comparison(workload: Workload, best: Plan, cluster: ClusterSpec) -> str:
    """Whether training one step off policy (generation on devices of its own, overlapping the rest of the
    step) pays on this cluster: the best plan of the other mode against ``best``."""
    other_mode = SYNC if workload.rollout_apart else ONE_STEP_OFF
    try:
        other = plan_run(workload.in_mode(other_mode), cluster)[0]
    except ValueError:
        return f"{other_mode}: no plan fits"
    one_step_off, sync = (best, other) if workload.rollout_apart else (other, best)
    ratio = sync.seconds / one_step_off.seconds
    verdict = "pays" if ratio > 1 else "does not pay"
    return (
        f"one step off policy (trainer.async_training.mode=one_step_off) {verdict} here: best plan "
        f"{one_step_off.seconds:.2f} s/step against {sync.seconds:.2f} s/step synchronous ({ratio:.2f}x)"
    )


def merged(base: dict, changes: dict) -> dict:
    """``base`` with ``changes`` written over it, key by key in nested sections."""
    result = dict(base)
    for key, value in changes.items():
        result[key] = (
            merged(result[key], value) if isinstance(value, dict) and isinstance(result.get(key), dict) else value
        )
    return result


def _layout_text(role: Role, layout, generates: bool) -> str:
    """``role t`` (``t/tg`` for an actor that generates), with ``spN`` under Ulysses, ``ppN`` with pipeline
    stages, ``pgN`` with generation stages and ``epN`` with split experts."""
    text = f"{role.value} {layout.t}/{layout.tg}" if generates else f"{role.value} {layout.t}"
    extra = {"sp": layout.sp, "pp": layout.pp, "pg": layout.pg, "ep": layout.ep}
    return text + "".join(f" {name}{size}" for name, size in extra.items() if size > 1)


def plans_table(plans: list[Plan], top: int) -> str:
    """The best ``top`` plans: sets (devices, layouts), seconds per phase and per step, memory."""
    names = ["gen", "score", "update", "transfer"]
    lines = [
        f"{'#':>2}  {'s/step':>9}  "
        + "".join(f"{n:>9}" for n in names)
        + "  sets (devices: role t/tg spN ppN pgN, GB/device)"
    ]
    for index, plan in enumerate(plans[:top], start=1):
        sets = "; ".join(
            f"{s.devices}: "
            + ", ".join(
                _layout_text(r, lay, r is Role.ActorRollout and not plan.overlapped) for r, lay in s.layouts.items()
            )
            + f" ({s.memory / 1e9:.1f})"
            for s in plan.sets
        )
        phases = "".join(f"{seconds:>9.2f}" for seconds in plan.phase_seconds)
        lines.append(f"{index:>2}  {plan.seconds:>9.2f}  {phases}  {sets}")
    return "\n".join(lines)


def _parse(args: list[str]) -> tuple[dict[str, str], list[str]]:
    flags, overrides = {}, []
    it = iter(args)
    for arg in it:
        if arg in FLAGS:
            value = next(it, None)
            if value is None:
                raise UserError(f"{arg} needs a value ({FLAGS[arg]}; see hybridflow plan --help)")
            flags[arg] = value
        elif arg.startswith("--"):
            raise UserError(f"unknown option {arg} (see hybridflow plan --help)")
        else:
            overrides.append(arg)
    return flags, overrides


def _count(flags: dict[str, str], flag: str, default: int) -> int:
    """A positive whole number given to ``flag``; UserError naming the flag otherwise."""
    text = flags.get(flag, str(default))
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"{flag} {text}: give a positive whole number (see hybridflow plan --help)")
    return int(text)


def main(args: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in args):
        print(USAGE)
        return 0
    if args == ["--calibrate"]:
        from hybridflow.planner.calibrate import calibrate

        print("calibrating the cpu preset on this machine (about a minute) ...", flush=True)
        cluster = calibrate(PRESETS["cpu"])
        path = save_calibration(cluster)
        for name, value in vars(cluster).items():
            print(f"  {name:<22} {value:.4g}" if isinstance(value, float) else f"  {name:<22} {value}")
        print(f"wrote {path}")
        return 0
    from hybridflow.trainer.setup.config import load_config

    flags, overrides = _parse(args)
    name = flags.get("--cluster", "cpu")
    if name not in PRESETS:
        raise UserError(f"--cluster {name}: no such preset; presets: {', '.join(PRESETS)}")
    cluster = cluster_preset(name, _count(flags, "--nodes", 1))
    config_file = flags.get("--config")
    config = load_config(overrides, config_file)
    workload = workload_from_config(config)
    mode = config.trainer.async_training.mode
    apart_mode = mode if training_mode(mode).rollout_apart else ONE_STEP_OFF
    try:
        plans = plan_run(workload, cluster)
    except ValueError as error:
        raise UserError(str(error)) from None
    top = _count(flags, "--top", 5)
    print(
        f"{len(plans)} feasible plans on {cluster.devices} x {cluster.name}; phases: "
        + ", ".join("+".join(p) for p in phases())
    )
    print(plans_table(plans, top))
    print(mode_comparison(workload, plans[0], cluster))
    out = Path(flags.get("--out", "plan.yaml"))
    base = OmegaConf.to_container(OmegaConf.load(config_file)) if config_file else {}
    out.write_text(OmegaConf.to_yaml(OmegaConf.create(merged(base, plan_overrides(plans[0], cluster, apart_mode)))))
    print(f"wrote the best plan to {out}: hybridflow train --config {out} (with the same key=value settings)")
    return 0
