"""The planner's search against brute force on small inputs, and memory as a hard constraint."""

import itertools
from dataclasses import replace

import pytest

from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.planner.cluster import cluster_preset
from hybridflow.planner.cost import layouts_for, memory_bytes, stage_seconds
from hybridflow.planner.search import Planner, device_splits, plan_run, set_partitions, step_plan
from hybridflow.planner.workload import PAPER_MODELS, ModelShape, Workload

SMALL = ModelShape(name="small", layers=4, hidden=256, heads=8, kv_heads=4, ffn=512, vocab=1000, tied_embeddings=False)
BIG = replace(SMALL, name="big", layers=16, hidden=1024, heads=16, kv_heads=8, ffn=4096)


def workload(**changes) -> Workload:
    models = {Role.ActorRollout: BIG, Role.RefPolicy: BIG, Role.Critic: SMALL, Role.RewardModel: SMALL}
    settings = {"models": models, "prompts": 8, "n": 4, "prompt_length": 64, "response_length": 64, "micro_batch": 2}
    return Workload(**(settings | changes))


def test_partitions_and_splits_by_counting():
    assert [len(list(set_partitions(list(range(k))))) for k in range(1, 6)] == [1, 2, 5, 15, 52]  # Bell numbers
    for partition in set_partitions([1, 2, 3, 4]):
        assert sorted(x for block in partition for x in block) == [1, 2, 3, 4]
    expected = [s for s in itertools.product(range(1, 9), repeat=3) if sum(s) == 8 and s[0] >= 2 and s[2] >= 3]
    assert sorted(device_splits(8, [2, 1, 3])) == sorted(expected)


def brute_force_best(planner: Planner) -> float:
    """Every assignment of the roles to labelled sets and every device count per set."""
    roles = list(planner.workload.models)
    total = planner.cluster.devices
    best = float("inf")
    for labels in itertools.product(range(len(roles)), repeat=len(roles)):
        used = sorted(set(labels))
        blocks = [tuple(r for r, label in zip(roles, labels) if label == u) for u in used]
        for devices in itertools.product(range(1, total + 1), repeat=len(blocks)):
            if sum(devices) != total:
                continue
            sets = [planner.device_set(block, n) for block, n in zip(blocks, devices)]
            if all(s is not None for s in sets):
                best = min(best, step_plan(sets).seconds)
    return best


@pytest.mark.parametrize("memory_gb", [2.0, 3.0, 8.0])
def test_the_search_finds_the_brute_force_optimum(memory_gb):
    cluster = replace(cluster_preset("a100-80g"), devices_per_node=4, device_memory=memory_gb * 1e9)
    planner = Planner(workload(), cluster)
    plans = planner.plans()
    assert plans, memory_gb
    assert plans[0].seconds == pytest.approx(brute_force_best(planner), rel=1e-12)
    assert [p.seconds for p in plans] == sorted(p.seconds for p in plans)


def test_a_model_layout_is_the_best_that_fits_and_nothing_chosen_overflows():
    cluster = replace(cluster_preset("a100-80g"), devices_per_node=4, device_memory=2.0e9)
    work = workload()
    planner = Planner(work, cluster)
    for role, shape in work.models.items():
        for devices in (1, 2, 4):
            fitting = [
                (sum(stage_seconds(role, shape, layout, work, cluster).values()), layout)
                for layout in layouts_for(role, shape, devices, cluster)
                if sum(memory_bytes(role, shape, layout, work)) <= cluster.device_memory
            ]
            chosen = planner.best_layout(role, devices)
            if not fitting:
                assert chosen is None and role is Role.ActorRollout and devices < 4  # 4.7 and 2.4 GB at best
            else:
                assert sum(chosen[1].values()) == pytest.approx(min(fitting, key=lambda f: f[0])[0])
    plans = planner.plans()

    def actor_fits(device_set) -> bool:  # on 4 devices, or on 3 with its tokens split over them (sp pads 16 heads)
        layout = device_set.layouts.get(Role.ActorRollout)
        return layout is not None and (device_set.devices == 4 or (device_set.devices == 3 and layout.sp == 3))

    assert plans and all(any(actor_fits(s) for s in p.sets) for p in plans)
    assert any(actor_fits(s) and s.devices == 3 for p in plans for s in p.sets)
    too_small = [p for p in plans if any(s.devices == 1 and Role.ActorRollout in s.roles for s in p.sets)]
    assert not too_small  # the big actor with its generation copy does not fit on one 2 GB device
    for plan in plans:
        for device_set in plan.sets:
            assert device_set.memory <= cluster.device_memory
            held = sum(memory_bytes(r, work.models[r], lay, work)[0] for r, lay in device_set.layouts.items())
            assert held <= cluster.device_memory


def test_no_plan_when_nothing_fits():
    cluster = replace(cluster_preset("a100-80g"), devices_per_node=2, device_memory=2.0e9)
    with pytest.raises(ValueError, match="no placement fits"):
        plan_run(workload(), cluster)


def test_paper_sizes_are_searched_in_whole_nodes():
    llama = PAPER_MODELS["llama-7b"]
    work = Workload(
        models={Role.ActorRollout: llama, Role.Critic: llama},
        prompts=1024, n=1, prompt_length=1024, response_length=1024, micro_batch=2, gradient_checkpointing=True,
    )  # fmt: skip
    plans = plan_run(work, cluster_preset("a100-80g", nodes=4))
    for plan in plans:
        assert sum(s.devices for s in plan.sets) == 32
        assert all(s.devices % 8 == 0 for s in plan.sets)
    assert llama.params == pytest.approx(6.74e9, rel=0.01)  # Llama-2 7B's published size


def test_a_long_sequence_that_fits_only_split_over_the_sequence_is_planned_with_ulysses():
    """32k-token samples of a large-vocabulary model: a micro-batch's logits alone outgrow a device unless its tokens
    are split (tensor parallelism splits the layers, not the logits), so the critic's layout on 4 devices is sp 4."""
    long = Workload(
        models={Role.ActorRollout: SMALL, Role.Critic: replace(SMALL, vocab=150_000)},
        prompts=4, n=1, prompt_length=1024, response_length=31 * 1024, micro_batch=1,
    )  # fmt: skip
    cluster = replace(cluster_preset("a100-80g"), devices_per_node=4, device_memory=8e9)
    critic = long.models[Role.Critic]
    fitting = [
        layout
        for layout in layouts_for(Role.Critic, critic, 4, cluster)
        if sum(memory_bytes(Role.Critic, critic, layout, long)) <= cluster.device_memory
    ]
    assert fitting and all(layout.sp == 4 for layout in fitting)
    chosen, _ = Planner(long, cluster).best_layout(Role.Critic, 4)
    assert (chosen.dp, chosen.sp, chosen.t) == (1, 4, 1)
    assert {(layout.sp, layout.t) for layout in layouts_for(Role.Critic, critic, 4, cluster)} == {
        (1, 1), (1, 2), (1, 4), (2, 1), (4, 1), (2, 2)
    }  # fmt: skip


def test_a_model_too_large_for_a_node_is_planned_with_stages_across_nodes():
    """The big actor fits on no device, nor on two (a node of this cluster) without tensor parallelism, and tensor
    parallelism stays in a node: on 4 devices over 2 nodes, splitting the layers into stages sends each micro-batch's
    activations where data parallelism gathers every weight over the slow link between the nodes."""
    cluster = replace(cluster_preset("a100-80g", nodes=2), devices_per_node=2, device_memory=2.0e9)
    work = workload(models={Role.ActorRollout: BIG})
    one_device = LayoutShape(dp=1, t=1, tg=1)
    assert sum(memory_bytes(Role.ActorRollout, BIG, one_device, work)) > cluster.device_memory
    assert sum(memory_bytes(Role.ActorRollout, BIG, LayoutShape(dp=2, t=1, tg=1), work)) > cluster.device_memory
    assert all(layout.t <= 2 for layout in layouts_for(Role.ActorRollout, BIG, 4, cluster))
    plan = plan_run(work, cluster)[0]
    (actor,) = plan.sets
    chosen = actor.layouts[Role.ActorRollout]
    assert actor.devices == 4 and chosen.pp > 1
    without_stages = [
        sum(stage_seconds(Role.ActorRollout, BIG, layout, work, cluster).values())
        for layout in layouts_for(Role.ActorRollout, BIG, 4, cluster)
        if layout.pp == 1 and sum(memory_bytes(Role.ActorRollout, BIG, layout, work)) <= cluster.device_memory
    ]
    assert without_stages and plan.seconds < min(without_stages)
