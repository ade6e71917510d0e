"""engine/fsdp.py on real gloo ranks: ``reshard_after_forward=false`` (a mini-batch gathers the weights once, for
the first micro-batch's forward; its backward and the micro-batches after it gather none; the step is bitwise the
same), ``fsdp.host_collectives`` (the same collectives through shared memory, bitwise gloo's update on 2 ranks) and
the gradient-norm clipping."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.engine.config import FSDPConfig
from hybridflow.engine.fsdp import (
    data_parallel_mesh,
    decoder_layers,
    full_parameters,
    grad_norm_and_clip,
    keeps_gathered_weights,
    shard_model,
)
from hybridflow.engine.host_collectives import ALL_GATHER_EVENT, REDUCE_SCATTER_EVENT
from hybridflow.engine.policy import PolicyEngine
from hybridflow.models import load_causal_lm
from hybridflow.workers.sharded_model import build_trainable

WORLD = 2


def _updates(rank: int, tiny_path: str, configs: dict, batch) -> dict:
    """One update per config (rank 0's results)."""
    results = {}
    for key, config in configs.items():
        actor = config.actor
        trained = build_trainable(
            load_causal_lm, tiny_path, config.model, actor.fsdp, actor.optim, torch.device("cpu"), 0, 10
        )
        engine = PolicyEngine(trained, actor)
        share = batch.chunk(WORLD)[rank]  # 3 rows each, micro-batches of 2: two forward/backward passes per rank
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.update_policy(share, len(share), 1.0, seed=0)
        names = [event.name for event in prof.events()]
        gathers = sum(1 for name in names if name == "FSDP::all_gather" or name.startswith("FSDP::all_gather ("))
        through_shared_memory = (names.count(ALL_GATHER_EVENT), names.count(REDUCE_SCATTER_EVENT))
        state = {name: tensor.detach().clone() for name, tensor in full_parameters(trained.model)}
        results[key] = (gathers, through_shared_memory, len(decoder_layers(trained.model)), state)
    return results


def _ranks(rank: int, tiny_path: str, init_file: str, configs: dict, batch, out: str) -> None:
    """Every check of this file in one process group: starting the ranks is most of the time."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        results = {"updates": _updates(rank, tiny_path, configs, batch), "clip": _clip(tiny_path)}
        if rank == 0:  # tensors through a file: a queue's shared memory is gone once this process exits
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


# (reshard_after_forward, host_collectives); None, the default, keeps the weights gathered on CPU
SETTINGS = [(True, True), (False, True), (None, False)]


@pytest.fixture(scope="module")
def ranks(tiny_path, tmp_path_factory, rollout_batch, actor_config_factory) -> dict:
    batch = rollout_batch.select(deepcopy=True)
    batch.batch["old_log_probs"] = torch.zeros_like(batch.batch["advantages"])  # ratio != 1 is fine: same both ways
    # the configs are built here and sent: the spawned ranks import this module, not the tests' conftest
    configs = {
        (reshard, shared): actor_config_factory(
            tiny_path,
            1e-2,
            "actor_rollout_ref.actor.fsdp.param_dtype=bf16",
            f"actor_rollout_ref.actor.reshard_after_forward={'null' if reshard is None else str(reshard).lower()}",
            f"actor_rollout_ref.actor.fsdp.host_collectives={str(shared).lower()}",
        )
        for reshard, shared in SETTINGS
    }
    directory = tmp_path_factory.mktemp("fsdp")
    out = str(directory / "results.pt")
    mp.spawn(_ranks, args=(tiny_path, str(directory / "init"), configs, batch, out), nprocs=WORLD)
    return torch.load(out)


def test_keeping_weights_gathered_and_shared_memory_collectives_change_no_bit(ranks, tiny_path):
    runs = ranks["updates"]
    default_gathers, default_shared, layers, default_state = runs[True, True]
    kept_gathers, kept_shared, _, kept_state = runs[False, True]
    gloo_gathers, gloo_shared, _, gloo_state = runs[None, False]  # and the default setting: kept on CPU
    micro_batches = 2
    # resharding (true), each micro-batch: every layer and the root gather in forward, and the layers again in backward;
    # kept: every layer and the root gather once, in the first forward
    assert default_gathers == micro_batches * (2 * layers + 1)
    assert kept_gathers == gloo_gathers == layers + 1
    # every gather and every reduce-scatter (each unit's, after each micro-batch's backward) went through shared
    # memory where it is on (the default), none where it is off
    assert default_shared == (default_gathers, micro_batches * (layers + 1))
    assert kept_shared == (kept_gathers, micro_batches * (layers + 1))
    assert gloo_shared == (0, 0)
    assert set(kept_state) == set(default_state) == set(gloo_state)
    initial = load_causal_lm(tiny_path, dtype=torch.float32).state_dict()
    for name, tensor in default_state.items():
        assert torch.equal(kept_state[name], tensor), name
        assert torch.equal(gloo_state[name], tensor), name
    assert any(not torch.equal(tensor, initial[name]) for name, tensor in default_state.items() if name in initial)


def _clip(tiny_path: str) -> tuple:
    torch.manual_seed(0)
    model = shard_model(
        load_causal_lm(tiny_path, dtype=torch.float32),
        data_parallel_mesh(torch.device("cpu")),
        FSDPConfig(param_dtype="fp32", reduce_dtype="fp32", host_collectives=True),
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    full = [p.grad.full_tensor().clone() for p in model.parameters()]
    expected_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full])).item()
    unclipped = grad_norm_and_clip(model, max_norm=10 * expected_norm)  # below the limit: no change
    same = all(torch.equal(p.grad.full_tensor(), g) for p, g in zip(model.parameters(), full))
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()
    norm = grad_norm_and_clip(model, max_norm=expected_norm / 4)  # scaled down to a quarter
    coefficient = torch.clamp((expected_norm / 4) / (total + 1e-6), max=1.0)  # torch's clip_grads_with_norm_
    quartered = all(torch.equal(p.grad.full_tensor(), g * coefficient) for p, g in zip(model.parameters(), full))
    return expected_norm, unclipped, same, norm, quartered


def test_gradient_norm_is_the_global_one_and_clips_only_above_the_limit(ranks):
    expected_norm, unclipped, same, norm, quartered = ranks["clip"]
    assert expected_norm > 0
    assert abs(unclipped - expected_norm) < 1e-5 * expected_norm
    assert same  # below the limit every gradient is left as it was, bit for bit
    assert abs(norm - expected_norm) < 1e-5 * expected_norm  # the norm before clipping is returned
    assert quartered  # above it, torch's clip_grads_with_norm_'s products, bit for bit


def test_null_keeps_the_gathered_weights_on_cpu_only():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert keeps_gathered_weights(None, cpu) and not keeps_gathered_weights(None, gpu)
    for device in (cpu, gpu):  # a setting is followed as given
        assert keeps_gathered_weights(False, device) and not keeps_gathered_weights(True, device)
