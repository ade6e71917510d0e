"""Weights from an actor pool (FSDP2 x DTensor tensor parallelism) to a rollout on its own pool, over a
gloo transfer group spanning both (real processes, at most 4 ranks in all): every rollout rank ends up
with exactly its generation shard of the actor's weights, in the generation dtype, having received
the bytes of the formula; a transfer that one side never joins in ends in a clear error in time."""

import copy
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from lora_helpers import lora_model
from test_reshard import prompts, trained_model
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridflow.batch_keys import RESPONSES
from hybridflow.controller import (
    Dispatch,
    Execute,
    RayResourcePool,
    RayWorkerGroup,
    RoleSpec,
    Worker,
    WorkerError,
    register,
)
from hybridflow.engine.fsdp import shard_model
from hybridflow.engine.lora import adapter_tensors, base_parameters, lora_scaling, policy_parameters
from hybridflow.engine.pipeline import build_pipelined, held_tensors, pipeline_mesh
from hybridflow.engine.tensor_parallel import apply_tensor_parallel
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.pool_transfer import (
    TransferAddress,
    TransferJoinError,
    TransferReport,
    WeightTransferStalled,
    host_transfer_store,
    join_transfer_group,
    receive_weights,
    send_weights,
)
from hybridflow.hybrid_engine.transfer_plan import (
    TransferPlan,
    adapter_transfer_params,
    plan_transfer,
    predicted_transfer_bytes,
    transfer_params,
)
from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.models.tensor_parallel import layer_split
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.parallel import TensorParallelGroup
from hybridflow.trainer.setup.config import default_config

GREEDY = SamplingParams.greedy(max_new_tokens=6, seed=0)
ENGINE = default_config().actor_rollout_ref.rollout.native
SPLIT = layer_split("qwen2")
FP32 = dataclasses.replace(default_config().actor_rollout_ref.actor.fsdp, param_dtype="fp32", reduce_dtype="fp32")
BUCKET_BYTES = 32 * 1024  # the tiny model's ~450 KB in many buckets; the embedding alone in one
TIMEOUT = 30.0  # seconds a side may wait for one bucket; a healthy transfer takes well under one


class Process(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class ActorSide(Process):
    """The actor's pool: the perturbed model trained-layout, (dp, t) over its first dp * t ranks (a
    rank beyond them holds a copy of its own and takes no part in the transfer)."""

    def __init__(self):
        super().__init__()
        torch.set_num_threads(1)
        self.store = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def build(self, path: str, dp: int, t: int, lora: bool = False) -> None:
        mesh = init_device_mesh("cpu", (self.world_size // (dp * t), dp, t), mesh_dim_names=("copy", "dp", "tp"))
        model = perturbed_lora_model(path) if lora else trained_model(path)
        apply_tensor_parallel(model, mesh["tp"])
        self.model = shard_model(model, mesh["dp"], FP32)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def build_stages(self, path: str, lora: bool = False) -> None:
        """The model in 2 pipeline stages over the 2 ranks (pp 2, dp 1, t 1)."""
        mesh = pipeline_mesh(torch.device("cpu"), 1, 2, 1)
        model = perturbed_lora_model(path) if lora else trained_model(path)
        unfused = dataclasses.replace(FP32, host_collectives=False)
        shard = lambda part: shard_model(part, mesh["dp"], unfused)  # noqa: E731
        self.model = build_pipelined(model, mesh, shard, stages_per_rank=1, activation_dtype=torch.float32)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def params(self, part: str = "policy") -> list:
        """What a transfer of ``part`` moves, as the actor's model (in stages: all of them) says."""
        return adapter_transfer_params(self.model) if part == "adapters" else transfer_params(self.model)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def host(self) -> TransferAddress:
        self.store, address = host_transfer_store(timeout=60.0)
        return address

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send(
        self,
        address: TransferAddress,
        plan: TransferPlan,
        dtype: torch.dtype,
        name: str,
        timeout: float,
        act: bool,
        part: str = "policy",
    ) -> TransferReport | None:
        """Join the transfer group; send the weights when ``act`` (else stop there: a stalled actor): the
        policy's, or a LoRA model's ``base`` or ``adapters``."""
        if self.rank >= plan.actors:
            return None
        store = self.store if self.rank == 0 else None
        self.group = join_transfer_group(  # kept: a group dropped closes its connections, its peers fail at once
            address, rank=self.rank, actors=plan.actors, rollouts=plan.rollouts, timeout=60.0, name=name, store=store
        )
        if not act:
            return None
        produce = {"policy": policy_parameters, "base": base_parameters, "adapters": adapter_tensors}[part]
        return send_weights(list(held_tensors(self.model, produce)), dtype, plan, self.group, timeout=timeout)


class RolloutSide(Process):
    """The rollout's pool: replicas of tg ranks (rank r: shard r % tg of replica r // tg), initial weights;
    ranks beyond replicas * tg take no part in the transfer."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def build(self, path: str, tg: int, dtype: torch.dtype) -> None:
        torch.set_num_threads(1)
        self.tg = tg
        grid = torch.arange(self.world_size).view(self.world_size // tg, tg)
        tp_group = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp"))["tp"].get_group() if tg > 1 else None
        original = load_causal_lm(path, dtype=torch.float32)
        tokenizer = load_tokenizer(path)
        self.rollout = NativeRollout(original, tokenizer, engine_config=ENGINE, dtype=dtype, tp_group=tp_group)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive(
        self,
        address: TransferAddress,
        plan: TransferPlan,
        dtype: torch.dtype,
        name: str,
        timeout: float,
        act: bool,
        part: str = "policy",
        scaling: float = 0.0,
    ) -> dict:
        """Join the transfer group; receive the weights into the engine when ``act`` (else: a stalled rollout):
        the policy's, or a LoRA model's ``base`` or ``adapters`` (of ``scaling``), served by the engine."""
        if self.rank >= plan.rollouts:
            return {}
        self.group = join_transfer_group(
            address, rank=plan.actors + self.rank, actors=plan.actors, rollouts=plan.rollouts, timeout=60.0, name=name
        )
        if not act:
            return {}
        report = TransferReport()
        self.waited = None
        start = time.perf_counter()
        try:
            weights = receive_weights(plan, self.group, report, dtype=dtype, timeout=timeout)
            if part == "base":
                self.rollout.load_base_weights(weights)
            elif part == "adapters":
                self.rollout.load_adapters(weights, scaling)
            else:
                self.rollout.load_weights(weights)
        finally:
            self.waited = time.perf_counter() - start
        weights = self.rollout.engine.weights
        return {
            "report": report,
            "weights": {name: weights.target(name)[0].clone() for name in weights.target_names()},
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def waited_s(self) -> float | None:
        return self.waited

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate(self) -> torch.Tensor:
        return self.rollout.generate_sequences(prompts(), GREEDY).batch[RESPONSES]


@pytest.fixture(scope="module")
def path():
    return str(resolve_model_path("tiny-qwen2", num_key_value_heads=4))  # 4 query and 4 key/value heads


@pytest.fixture(scope="module")
def expected(path):
    """The perturbed weights whole, and what one process generates greedily with them."""
    model = trained_model(path)
    single = NativeRollout(model, load_tokenizer(path), engine_config=ENGINE)
    return model, single.generate_sequences(prompts(), GREEDY).batch[RESPONSES]


@pytest.fixture(scope="module")
def pools(local_ray):
    """An actor pool and a rollout pool of 2 ranks each, for every case (a case may use fewer ranks);
    started side by side, as their processes' start (imports) is most of this file's time."""
    made = [RayResourcePool([2], name="actor"), RayResourcePool([2], name="rollout")]
    with ThreadPoolExecutor(2) as threads:
        starting = [
            threads.submit(RayWorkerGroup, made[0], RoleSpec(ActorSide), "actor"),
            threads.submit(RayWorkerGroup, made[1], RoleSpec(RolloutSide), "rollout"),
        ]
    groups = [start.result() for start in starting]
    yield groups
    for pool in made:  # their processes are kept for later groups (tests/conftest.py)
        pool.release()


def transfer(
    pools: list[RayWorkerGroup],
    path: str,
    *,
    dp: int,
    t: int,
    replicas: int,
    tg: int,
    dtype: torch.dtype,
    name: str,
    model,
) -> tuple[TransferPlan, list, list]:
    """Build both sides for the case and run one transfer: (plan, actor reports, rollout outputs)."""
    actor, rollout = pools
    actor.build(path, dp, t)
    rollout.build(path, tg, dtype)
    plan = plan_transfer(
        LayoutShape(dp=dp, t=t, tg=1),
        replicas=replicas,
        tg=tg,
        params=transfer_params(model),
        element_size=dtype.itemsize,
        bucket_bytes=BUCKET_BYTES,
    )
    address = actor.host()
    sent = actor.send.future(address, plan, dtype, name, TIMEOUT, True)
    received = rollout.receive.future(address, plan, dtype, name, TIMEOUT, True)
    return plan, sent.get(), received.get()


CASES = [
    pytest.param(1, 2, 1, 2, torch.float32, id="dp1t2-tg2x1-fp32"),
    pytest.param(2, 1, 2, 1, torch.bfloat16, id="dp2t1-tg1x2-bf16"),
    pytest.param(1, 2, 1, 1, torch.float32, id="dp1t2-tg1x1-fp32"),
    pytest.param(1, 1, 1, 2, torch.bfloat16, id="dp1t1-tg2x1-bf16"),
]


@pytest.mark.parametrize("dp, t, replicas, tg, dtype", CASES)
def test_each_rollout_rank_receives_exactly_its_generation_shard(pools, path, expected, dp, t, replicas, tg, dtype):
    model, responses = expected
    name = f"case-{dp}-{t}-{replicas}-{tg}-{dtype}".replace("torch.", "")
    plan, reports, outputs = transfer(
        pools, path, dp=dp, t=t, replicas=replicas, tg=tg, dtype=dtype, name=name, model=model
    )
    full = dict(model.named_parameters())
    split = sum(w.numel() for n, w in full.items() if SPLIT.shard_dim(n) is not None) * dtype.itemsize
    whole = sum(w.numel() for n, w in full.items() if SPLIT.shard_dim(n) is None) * dtype.itemsize
    outputs = outputs[: replicas * tg]
    for rank, out in enumerate(outputs):
        shard = TensorParallelGroup(SPLIT, size=tg, rank=rank % tg)
        for weight, got in out["weights"].items():
            want = shard.shard(weight, full[weight].detach()).to(dtype)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{weight} on rollout rank {rank}")
        report = out["report"]
        assert report.received == plan.received_bytes(rank) == report.predicted
        assert report.received == predicted_transfer_bytes(split, whole, tg)
        assert report.buckets == len(plan.receives(rank)) > 1
    reports = reports[: dp * t]
    for rank, report in enumerate(reports):
        assert report.sent == plan.sent_bytes(rank) == report.predicted
    assert sum(r.sent for r in reports) == sum(o["report"].received for o in outputs)
    if (dp, t, replicas, tg, dtype) == (1, 2, 1, 2, torch.float32):  # the rollout generates with them
        _, rollout = pools
        assert all(torch.equal(r, responses) for r in rollout.generate())


def perturbed_lora_model(path: str):
    """The perturbed model with rank-4 adapters on every linear layer."""
    return lora_model(trained_model(path), seed=2)


@pytest.mark.parametrize("dp, t, tg", [(1, 2, 2), (1, 2, 1), (2, 1, 2)], ids=["dp1t2-tg2", "dp1t2-tg1", "dp2t1-tg2"])
def test_a_lora_policy_crosses_as_its_base_then_its_adapters_each_split_like_its_layer(pools, path, dp, t, tg):
    """The base by the model's plan, then the adapters by their own (each rollout rank receiving its slices, the
    bytes of the formula); the engine serves them split over tg and generates what peft's merged model does."""
    model = perturbed_lora_model(path)
    merged = copy.deepcopy(model).merge_and_unload()
    expected = NativeRollout(merged, load_tokenizer(path), engine_config=ENGINE).generate_sequences(prompts(), GREEDY)
    actor, rollout = pools
    actor.build(path, dp, t, True)
    rollout.build(path, tg, torch.float32)
    name = f"lora-{dp}-{t}-{tg}"
    for part, params in [("base", transfer_params(model)), ("adapters", adapter_transfer_params(model))]:
        plan = plan_transfer(
            LayoutShape(dp=dp, t=t, tg=1), replicas=1, tg=tg, params=params, element_size=4, bucket_bytes=BUCKET_BYTES
        )
        address = actor.host()
        args = (address, plan, torch.float32, f"{name}-{part}", TIMEOUT, True, part)
        sent = actor.send.future(*args)
        received = rollout.receive.future(*args, lora_scaling(model))
        sent = sent.get()[: dp * t]
        received = received.get()[:tg]
        for rank, out in enumerate(received):
            assert out["report"].received == plan.received_bytes(rank) == out["report"].predicted
        assert sum(r.sent for r in sent) == sum(o["report"].received for o in received)
    adapters = dict(adapter_tensors(model))
    split = sum(a.numel() * 4 for n, a in adapters.items() if SPLIT.shard_dim(n) is not None)
    whole = sum(a.numel() * 4 for n, a in adapters.items() if SPLIT.shard_dim(n) is None)
    assert split and whole  # B of the column-split layers and A of the row-split ones are sliced, the rest whole
    assert sum(o["report"].received for o in received) == split + whole * tg
    assert all(torch.equal(r, expected.batch[RESPONSES]) for r in rollout.generate()[:tg])


@pytest.mark.parametrize("lora, replicas, tg", [(False, 1, 2), (True, 2, 1)], ids=["stages-tg2", "lora-stages-2x1"])
def test_an_actor_in_pipeline_stages_sends_each_weight_from_its_stage(pools, path, expected, lora, replicas, tg):
    """pp 2: each weight comes from the rank of its stage (the embedding from the first, the final norm from the
    last; the tied head is the embedding, sent once); every rollout rank receives exactly its generation shard, the
    bytes of the formula, and generates what one process does."""
    model = perturbed_lora_model(path) if lora else expected[0]
    actor, rollout = pools
    actor.build_stages(path, lora)
    rollout.build(path, tg, torch.float32)
    parts = [("base", transfer_params(model)), ("adapters", adapter_transfer_params(model))] if lora else []
    parts = parts or [("policy", transfer_params(model))]
    received = []
    for part, whole_model in parts:
        params = actor.params(part)
        assert params[0] == params[1]  # the same list on both ranks
        params = params[0]
        assert [(p.name, p.shape, p.dim) for p in params] == [(p.name, p.shape, p.dim) for p in whole_model]
        holders = {p.name: p.holder for p in params}
        if part != "adapters":
            assert holders["model.embed_tokens.weight"] == 0 and holders["model.norm.weight"] == 1
            assert "lm_head.weight" not in holders  # tied: the embedding
        assert {holders[p.name] for p in params if ".layers.0." in p.name} == {0}
        assert {holders[p.name] for p in params if ".layers.1." in p.name} == {1}
        plan = plan_transfer(
            LayoutShape(dp=1, pp=2, t=1, tg=1),
            replicas=replicas,
            tg=tg,
            params=params,
            element_size=4,
            bucket_bytes=BUCKET_BYTES,
        )
        address = actor.host()
        args = (address, plan, torch.float32, f"stages-{lora}-{part}", TIMEOUT, True, part)
        sent = actor.send.future(*args)
        received = rollout.receive.future(*args, lora_scaling(model) if lora else 0.0).get()
        sent = sent.get()
        for rank, report in enumerate(sent):
            assert report.sent == plan.sent_bytes(rank) == report.predicted > 0
        for rank, out in enumerate(received):
            assert out["report"].received == plan.received_bytes(rank) == out["report"].predicted
        assert sum(r.sent for r in sent) == sum(o["report"].received for o in received)
    if lora:
        merged = copy.deepcopy(model).merge_and_unload()
        single = NativeRollout(merged, load_tokenizer(path), engine_config=ENGINE)
        responses = single.generate_sequences(prompts(), GREEDY).batch[RESPONSES]
    else:
        responses = expected[1]
        full = dict(model.named_parameters())
        for rank, out in enumerate(received):
            shard = TensorParallelGroup(SPLIT, size=tg, rank=rank % tg)
            for weight, got in out["weights"].items():
                want = shard.shard(weight, full[weight].detach())
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{weight} on rollout rank {rank}")
    assert all(torch.equal(r, responses) for r in rollout.generate()[: replicas * tg])


def test_a_rollout_waiting_for_an_actor_that_never_sends_fails_in_time_naming_both(pools, path, expected):
    model, _ = expected
    actor, rollout = pools
    actor.build(path, 1, 1)
    rollout.build(path, 2, torch.float32)
    params = transfer_params(model)
    plan = plan_transfer(LayoutShape(dp=1, t=1, tg=1), replicas=1, tg=2, params=params, element_size=4)
    timeout = 3.0
    address = actor.host()
    joined = actor.send.future(address, plan, torch.float32, "stall-actor", timeout, False)  # joins, never sends
    waiting = rollout.receive.future(address, plan, torch.float32, "stall-actor", timeout, True)
    assert joined.get() == [None, None]
    with pytest.raises(WorkerError) as raised:
        waiting.get()
    assert isinstance(raised.value.cause, WeightTransferStalled)
    message = str(raised.value.cause)
    assert "rollout rank" in message and "actor rank 0" in message and "the actor side stopped" in message
    assert "bucket 1 of 1" in message and "model.embed_tokens.weight" in message
    waited = rollout.waited_s()
    assert all(timeout <= w < timeout + 2.0 for w in waited), waited

    # the other way round: the actor sends, the rollout joins and never receives
    address = actor.host()
    sending = actor.send.future(address, plan, torch.float32, "stall-rollout", timeout, True)
    assert rollout.receive.future(address, plan, torch.float32, "stall-rollout", timeout, False).get() == [{}, {}]
    start = time.perf_counter()
    with pytest.raises(WorkerError) as raised:
        sending.get()
    assert time.perf_counter() - start < timeout + 5.0
    assert isinstance(raised.value.cause, WeightTransferStalled)
    message = str(raised.value.cause)
    assert "actor rank 0 waited 3 s for rollout rank" in message and "the rollout side stopped" in message

    # nothing is left hanging: both pools still answer, and their processes end when killed
    pids = actor.pid() + rollout.pid()
    for group in pools:
        group.kill()
    deadline = time.monotonic() + 30.0
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_joining_without_the_other_pool_fails_in_time_naming_the_missing_ranks():
    store, address = host_transfer_store(host="127.0.0.1", timeout=10.0)
    start = time.perf_counter()
    with pytest.raises(TransferJoinError, match=r"actor rank 0 waited 1 s for rollout rank 0, rollout rank 1 to join"):
        join_transfer_group(address, rank=0, actors=1, rollouts=2, timeout=1.0, store=store)
    assert time.perf_counter() - start < 3.0
    with pytest.raises(TransferJoinError, match="rollout rank 0 could not join within 1 s"):
        join_transfer_group(TransferAddress("127.0.0.1", 1), rank=1, actors=1, rollouts=1, timeout=1.0)
