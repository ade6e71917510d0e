"""The 3D-HybridEngine's switch on real layouts: a tiny Qwen2 (q/k/v biases, tied head) trained as
(dp, t) under FSDP2 + DTensor, switched to generation groups of tg (gloo ranks, fp32).

After the switch every rank holds exactly its generation slice of the trained weights, received
exactly the bytes the paper's formula predicts, and its generation group generates what one process
with the whole trained model generates.

One group of 4 ranks runs every 4-rank layout in turn and one of 2 ranks the rest (each call builds its layouts,
model and engine anew): starting a rank's process is most of this file's time."""

import dataclasses
import gc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSES
from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register
from hybridflow.engine.fsdp import shard_model
from hybridflow.engine.host_collectives import ALL_GATHER_EVENT, host_collectives_for
from hybridflow.engine.pipeline import build_pipelined
from hybridflow.engine.tensor_parallel import apply_tensor_parallel
from hybridflow.hybrid_engine.layout import ActorLayouts
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.regroup import Regrouping, predicted_switch_bytes
from hybridflow.hybrid_engine.reshard import SwitchReport, gather_rows, generation_weights
from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.models.tensor_parallel import layer_split
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.parallel import TensorParallelGroup
from hybridflow.trainer.setup.config import default_config

GREEDY = SamplingParams.greedy(max_new_tokens=6, seed=0)
ENGINE = default_config().actor_rollout_ref.rollout.native
SPLIT = layer_split("qwen2")
FP32 = dataclasses.replace(default_config().actor_rollout_ref.actor.fsdp, param_dtype="fp32", reduce_dtype="fp32")


def trained_model(path: str):
    """The model with seeded changes, standing in for training (the generator starts from the original)."""
    model = load_causal_lm(path, dtype=torch.float32)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(0.05 * torch.randn(param.shape, generator=noise))
    return model


def prompts() -> DataProto:
    ids = torch.tensor([[0, 5, 9, 13, 21], [0, 0, 7, 8, 9], [3, 4, 5, 6, 7], [0, 0, 0, 40, 41]])
    mask = (ids != 0).long()
    return DataProto.from_dict({INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: (mask.cumsum(1) - 1).clamp(min=0)})


def switch_and_generate(model, layouts: ActorLayouts, path: str) -> tuple[NativeRollout, SwitchReport, torch.Tensor]:
    """A generation engine of the layouts' groups holding the original weights, switched to ``model``'s (trained,
    in the training layout): the engine, what the switch moved, and the greedy responses to this rank's prompts."""
    original = load_causal_lm(path, dtype=torch.float32)
    rollout = NativeRollout(
        original,
        load_tokenizer(path),
        engine_config=ENGINE,
        tp_group=layouts.generation_group,
        pp_group=layouts.generation_stage_group,
    )
    report = SwitchReport()
    stages = layouts.stage_gather_group
    rollout.load_weights(
        generation_weights(model, torch.float32, layouts.gather_group, report, stage_gather_group=stages)
    )
    generation = layouts.generation
    batch = prompts().chunk(generation["dp"].size())[generation["dp"].get_local_rank()]
    return rollout, report, rollout.generate_sequences(batch, GREEDY).batch[RESPONSES]


class ActorSwitch(Worker):
    def __init__(self):
        super().__init__()
        torch.set_num_threads(1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def switch_and_generate(self, path: str, t: int, tg: int) -> dict:
        """Train-layout (world / t, t) shards of the trained model and a generation engine of tg ranks holding the
        original; switch the engine to the trained weights and generate."""
        shape = LayoutShape(dp=self.world_size // t, t=t, tg=tg)
        layouts = ActorLayouts.build(self.device, shape)
        model = trained_model(path)
        apply_tensor_parallel(model, layouts.training["tp"])
        model = shard_model(model, layouts.training["dp"], FP32)
        rollout, report, responses = switch_and_generate(model, layouts, path)
        generation = layouts.generation
        layer = rollout.engine.weights.layers[0]
        dist.barrier()
        return {
            "report": report,
            "predicted": report.predicted(shape),
            "generation_index": (generation["dp"].get_local_rank(), generation["tp"].get_local_rank()),
            "qkv": layer.qkv.weight.clone(),
            "qkv_bias": layer.qkv.bias.clone(),
            "down": layer.down.weight.clone(),
            "responses": responses,
        }


@pytest.fixture(scope="module")
def path():
    return str(resolve_model_path("tiny-qwen2", num_key_value_heads=4))  # 4 query and 4 key/value heads


class RowGather(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gather(self, wholes: list[torch.Tensor]) -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("dp",))
        parts = [distribute_tensor(whole, mesh, [Shard(0)]) for whole in wholes]
        return gather_rows(parts)


class DataParallelWeights(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def data_parallel_weights(self, path: str, bucket_bytes: int) -> tuple[dict, SwitchReport, int, bool, bool]:
        """The generation weights of a model that FSDP2 alone shards over every rank (the demo's layout), with
        the collectives it took through shared memory, whether its group has them, and whether they went with the
        model (a kept process must not hold a finished run's shared memory)."""
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("dp",))
        model = shard_model(trained_model(path), mesh, FP32)
        report = SwitchReport()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            weights = dict(generation_weights(model, torch.float32, None, report, bucket_bytes=bucket_bytes))
        gathers = sum(1 for event in prof.events() if event.name == ALL_GATHER_EVENT)
        shared = host_collectives_for(mesh.get_group()) is not None
        del model, prof
        gc.collect()
        return weights, report, gathers, shared, host_collectives_for(mesh.get_group()) is None


class PipelinedSwitch(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def switch_pipelined_and_generate(self, path: str, pp: int, t: int, tg: int, pg: int = 1, sp: int = 1) -> dict:
        """Pipeline stages of the trained model in the (dp x sp, pp, t) layout switched to generation groups of
        pg x tg (pg = 1: every rank generates with every layer)."""
        torch.set_num_threads(1)
        shape = LayoutShape(dp=self.world_size // (pp * t * sp), t=t, tg=tg, pp=pp, pg=pg, sp=sp)
        layouts = ActorLayouts.build(self.device, shape)

        def shard(part):
            apply_tensor_parallel(part, layouts.training["tp"])
            return shard_model(part, layouts.training["dp"], dataclasses.replace(FP32, host_collectives=False))

        model = build_pipelined(
            trained_model(path), layouts.training, shard, stages_per_rank=1, activation_dtype=torch.float32
        )
        rollout, report, responses = switch_and_generate(model, layouts, path)
        generation = layouts.generation
        dist.barrier()
        return {
            "report": report,
            "predicted": report.predicted(shape),
            "stage": model.indices[0],
            "generation_index": (generation["dp"].get_local_rank(), generation["tp"].get_local_rank()),
            "generation_stage": generation["pp"].get_local_rank() if pg > 1 else 0,
            "held_layers": list(rollout.engine.weights.held_layers),
            "down": [layer.down.weight.clone() for layer in rollout.engine.weights.layers],
            "responses": responses,
        }


class Ranks(ActorSwitch, RowGather, DataParallelWeights, PipelinedSwitch):
    """The tests' methods, so that one group of each size serves every case."""


@pytest.fixture(scope="module")
def groups(local_ray):
    """Groups of 2 and of 4 ranks, started side by side."""
    pools = {size: RayResourcePool([size]) for size in (2, 4)}
    with ThreadPoolExecutor(2) as threads:
        starting = {size: threads.submit(RayWorkerGroup, pool, RoleSpec(Ranks)) for size, pool in pools.items()}
    made = {size: start.result() for size, start in starting.items()}
    yield made
    for pool in pools.values():
        pool.release()


@pytest.fixture(scope="module")
def expected(path):
    """The trained weights whole, and what one process generates with them."""
    model = trained_model(path)
    single = NativeRollout(model, load_tokenizer(path), engine_config=ENGINE)
    return dict(model.named_parameters()), single.generate_sequences(prompts(), GREEDY).batch[RESPONSES]


def first_layer_slice(weights: dict, name: str, tg: int, index: int) -> torch.Tensor:
    full = weights[f"model.layers.0.{name}"].detach()
    return TensorParallelGroup(SPLIT, size=tg, rank=index).shard(f"model.layers.0.{name}", full)


@pytest.mark.parametrize("dp, t, tg", [(1, 2, 2), (2, 2, 1), (2, 2, 2), (1, 4, 2), (1, 4, 4)])
def test_the_switch_builds_each_generation_shard_with_the_predicted_bytes(groups, path, expected, dp, t, tg):
    weights, responses = expected
    outputs = groups[dp * t].switch_and_generate(path, t, tg)
    split = sum(w.numel() * 4 for n, w in weights.items() if SPLIT.shard_dim(n) is not None)
    whole = sum(w.numel() * 4 for n, w in weights.items() if SPLIT.shard_dim(n) is None)
    regrouping = Regrouping(t=t, tg=tg)
    by_group: dict[int, list[torch.Tensor]] = {}
    for rank, out in enumerate(outputs):
        gen_dp, gen_tp = out["generation_index"]
        assert gen_tp == regrouping.generation_shard(rank % t)  # the strided groups of §5.3
        report = out["report"]
        assert (report.split, report.whole) == (split, whole)
        assert (
            report.received
            == out["predicted"]
            == predicted_switch_bytes(split, whole, dp=dp, t=t, tg=tg, method="hybridflow")
        )
        assert report.held == split // tg + whole  # 1/tg of the split weights, never a whole copy
        qkv = torch.cat([first_layer_slice(weights, f"self_attn.{p}_proj.weight", tg, gen_tp) for p in "qkv"])
        qkv_bias = torch.cat([first_layer_slice(weights, f"self_attn.{p}_proj.bias", tg, gen_tp) for p in "qkv"])
        torch.testing.assert_close(out["qkv"], qkv, rtol=0, atol=0)
        torch.testing.assert_close(out["qkv_bias"], qkv_bias, rtol=0, atol=0)
        torch.testing.assert_close(out["down"], first_layer_slice(weights, "mlp.down_proj.weight", tg, gen_tp))
        by_group.setdefault(gen_dp, []).append(out["responses"])
    assert len(by_group) == dp * t // tg
    for same_prompts in by_group.values():  # a group's ranks generate alike
        assert all(torch.equal(r, same_prompts[0]) for r in same_prompts)
    assert torch.equal(torch.cat([by_group[g][0] for g in sorted(by_group)]), responses)


def test_adapters_gather_whole_in_one_collective_whatever_their_rows(groups):
    """Rows that 2 ranks split evenly, unevenly, or not at all (one row: the second rank holds none)."""
    generator = torch.Generator().manual_seed(0)
    wholes = [torch.randn(shape, generator=generator) for shape in [(5, 3), (1, 4), (4,), (2, 2, 2), (8, 1)]]
    for got in groups[2].gather(wholes):
        assert len(got) == len(wholes)
        for have, want in zip(got, wholes):
            assert torch.equal(have, want)


def test_data_parallel_weights_travel_a_bucket_at_a_time_through_shared_memory(groups, path, expected):
    """FSDP2 alone over 2 ranks on one host: the weights are gathered a bucket (here 64 KiB) at a time, each in
    one collective through shared memory, and arrive exact, with the bytes of a whole copy received but a shard."""
    weights, _ = expected
    bucket = 64 << 10
    sizes = [w.numel() * 4 for w in weights.values()]
    buckets, filled = 0, 0  # the buckets the parameters fill in order (a tensor larger than one has its own)
    for size in sizes:
        if not buckets or filled + size > bucket:
            buckets, filled = buckets + 1, 0
        filled += size
    whole = sum(sizes)
    for rank, (got, report, gathers, shared, released) in enumerate(groups[2].data_parallel_weights(path, bucket)):
        assert shared and released
        assert 1 < buckets < len(weights) and gathers == buckets
        for name, want in weights.items():
            assert torch.equal(got[name], want.detach()), name
        # rank 0 holds the first ceil(rows / 2) rows of every tensor, rank 1 the rest: it received the others
        own = [-(-w.shape[0] // 2) if rank == 0 else w.shape[0] - -(-w.shape[0] // 2) for w in weights.values()]
        held_before = sum(rows * w[0].numel() * 4 for rows, w in zip(own, weights.values()))
        assert report.whole == report.held == whole
        assert report.received == whole - held_before


def stage_of(name: str) -> int:
    """The stage of 2 (one layer each) that holds a weight of the tiny Qwen2: the embedding on the first, the final
    norm on the last (its tied head is the embedding)."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return 0 if "embed_tokens" in name else 1


@pytest.mark.parametrize("dp, pp, t, tg", [(1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 2), (1, 2, 2, 1)])
def test_pipeline_stages_switch_to_every_layer_on_every_rank_with_the_predicted_bytes(
    groups, path, expected, dp, pp, t, tg
):
    """Each rank gathers its stage's generation shard as without stages (the paper's bytes) and receives the other
    stage's from its pp peer, 1/tg of each split weight: every rank then holds its generation shard of every layer,
    and each generation group generates what one process does."""
    weights, responses = expected
    outputs = groups[dp * pp * t].switch_pipelined_and_generate(path, pp, t, tg)

    def nbytes(stage: int, split: bool) -> int:  # split: what the training layout splits (nothing at t = 1)
        return sum(
            w.numel() * 4
            for n, w in weights.items()
            if stage_of(n) == stage and (t > 1 and SPLIT.shard_dim(n) is not None) == split
        )

    by_group: dict[int, list[torch.Tensor]] = {}
    for out in outputs:
        stage, (gen_dp, gen_tp) = out["stage"], out["generation_index"]
        report, other = out["report"], 1 - stage
        own = predicted_switch_bytes(nbytes(stage, True), nbytes(stage, False), dp=dp, t=t, tg=tg, method="hybridflow")
        from_stages = nbytes(other, True) // tg + nbytes(other, False)
        assert (report.split, report.whole) == (nbytes(stage, True), nbytes(stage, False))
        assert report.received == out["predicted"] == own + from_stages
        assert report.held == sum(nbytes(s, True) // tg + nbytes(s, False) for s in (0, 1))
        for index, down in enumerate(out["down"]):  # every layer, this rank's generation shard of it
            torch.testing.assert_close(down, first_layer_slice_of(weights, index, tg, gen_tp), rtol=0, atol=0)
        by_group.setdefault(gen_dp, []).append(out["responses"])
    assert len(by_group) == dp * pp * t // tg
    for same_prompts in by_group.values():
        assert all(torch.equal(r, same_prompts[0]) for r in same_prompts)
    assert torch.equal(torch.cat([by_group[g][0] for g in sorted(by_group)]), responses)


def first_layer_slice_of(weights: dict, layer: int, tg: int, index: int) -> torch.Tensor:
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    return TensorParallelGroup(SPLIT, size=tg, rank=index).shard(name, weights[name].detach())


@pytest.fixture(scope="module")
def deep_path():
    return str(resolve_model_path("tiny-qwen2", num_key_value_heads=4, num_hidden_layers=4))


@pytest.fixture(scope="module")
def deep_expected(deep_path):
    model = trained_model(deep_path)
    single = NativeRollout(model, load_tokenizer(deep_path), engine_config=ENGINE)
    return dict(model.named_parameters()), single.generate_sequences(prompts(), GREEDY).batch[RESPONSES]


@pytest.mark.parametrize(
    "dp, pp, t, tg, pg, deep, sp",
    [
        (1, 2, 1, 1, 2, False, 1),
        (2, 2, 1, 1, 2, False, 1),
        (1, 2, 2, 2, 2, False, 1),
        (1, 4, 1, 1, 2, True, 1),
        (1, 2, 1, 1, 2, False, 2),  # Ulysses beside the stages: FSDP2 over the 2 sp ranks of each stage
        (1, 2, 1, 1, 1, False, 2),
    ],
)
def test_generation_stages_gather_only_their_layers_with_the_predicted_bytes(
    groups, path, expected, deep_path, deep_expected, dp, pp, t, tg, pg, deep, sp
):
    """Generation in pg stages (§5.3's regrouping over p): the n = pp / pg ranks whose training stages make one
    generation stage exchange those stages' layers (1/tg of each split weight) and nothing else of the layers; every
    rank takes the embedding, the final norm and the head from the stages holding them. Each rank then holds exactly
    its generation stage's layers (pp = 4, pg = 2: the stages {0, 1} and {2, 3} gathered, ranks {0, 2} and {1, 3}
    generating together), and each generation group generates what one process does."""
    path, (weights, responses) = (deep_path, deep_expected) if deep else (path, expected)
    layers = 4 if deep else 2
    outputs = groups[dp * sp * pp * t].switch_pipelined_and_generate(path, pp, t, tg, pg, sp)
    n = pp // pg

    def stage_of_weight(name: str) -> int:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) * pp // layers
        return 0 if "embed_tokens" in name else pp - 1

    def nbytes(stage: int, split: bool, layer: bool | None = None) -> int:
        return sum(
            w.numel() * 4
            for name, w in weights.items()
            if stage_of_weight(name) == stage
            and (t > 1 and SPLIT.shard_dim(name) is not None) == split
            and (layer is None or name.startswith("model.layers.") == layer)
        )

    def generation_shard(stage: int, layer: bool | None = None) -> int:
        return nbytes(stage, True, layer) // tg + nbytes(stage, False, layer)

    by_group: dict[int, list[torch.Tensor]] = {}
    for out in outputs:
        stage, (gen_dp, gen_tp), gen_stage = out["stage"], out["generation_index"], out["generation_stage"]
        block = range(stage // n * n, stage // n * n + n)  # the training stages of this rank's generation stage
        assert gen_stage == stage // n
        report = out["report"]
        own = predicted_switch_bytes(
            nbytes(stage, True), nbytes(stage, False), dp=dp * sp, t=t, tg=tg, method="hybridflow"
        )
        from_stages = sum(
            generation_shard(other) if other in block else generation_shard(other, layer=False)
            for other in range(pp)
            if other != stage
        )
        assert report.received == out["predicted"] == own + from_stages
        assert report.held == sum(
            generation_shard(s) if s in block else generation_shard(s, layer=False) for s in range(pp)
        )
        per_stage = layers // pg
        assert out["held_layers"] == list(range(gen_stage * per_stage, (gen_stage + 1) * per_stage))
        for index, down in zip(out["held_layers"], out["down"]):
            torch.testing.assert_close(down, first_layer_slice_of(weights, index, tg, gen_tp), rtol=0, atol=0)
        by_group.setdefault(gen_dp, []).append(out["responses"])
    assert len(by_group) == dp * sp * pp * t // (tg * pg)
    for same_prompts in by_group.values():
        assert len(same_prompts) == tg * pg and all(torch.equal(r, same_prompts[0]) for r in same_prompts)
    assert torch.equal(torch.cat([by_group[g][0] for g in sorted(by_group)]), responses)
