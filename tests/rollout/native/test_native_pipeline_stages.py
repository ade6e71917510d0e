"""The native engine in generation pipeline stages (pg = 2) over gloo ranks against one process, fp32.

Each stage holds its half of the decoder layers and of the KV cache; every rank of a group must produce the same
tokens as one process, with log-probs equal to rounding, and a mixture's recorded routes equal (every layer's, each
stage filling its own). With 4 ranks, pg = 2 x tg = 2: each stage tensor-parallel as well."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from lora_helpers import lora_model
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of, sampled

from hybridflow.batch_keys import RESPONSES, ROLLOUT_LOG_PROBS, ROUTED_EXPERTS
from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register
from hybridflow.engine.lora import adapter_tensors, lora_scaling
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.spec import spec_from_config
from hybridflow.rollout.native.stages import PipelineStageGroup

PG = 2


def _groups(tg: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup]:
    """This rank's tensor-parallel group (consecutive ranks) and pipeline group (ranks with its tp index)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = torch.arange(world).view(world // tg, tg)
    tp_group = pp_group = None
    for row in grid.tolist():
        made = dist.new_group(row)
        if rank in row:
            tp_group = made
    for column in grid.t().tolist():
        made = dist.new_group(column)
        if rank in column:
            pp_group = made
    return (tp_group if tg > 1 else None), pp_group


class StagedGenerator(Worker):
    def __init__(self, *, name: str, tg: int):
        super().__init__()
        torch.set_num_threads(1)
        model = load_causal_lm(name, dtype=torch.float32).eval()
        tp_group, pp_group = _groups(tg)
        self.rollout = NativeRollout(
            model, load_tokenizer(name), engine_config=engine_config(), tp_group=tp_group, pp_group=pp_group
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate(self, prompts, params) -> dict[str, torch.Tensor]:
        output = self.rollout.generate_sequences(prompts, params)
        return {key: output.batch[key] for key in (RESPONSES, ROLLOUT_LOG_PROBS, ROUTED_EXPERTS) if key in output.batch}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_adapters(self, adapters: dict[str, torch.Tensor], scaling: float) -> None:
        """Serve the adapters of this rank's layers (what a switch sends it), each as its tensor-parallel slice."""
        weights = self.rollout.engine.weights
        held = {f"model.layers.{index}." for index in weights.held_layers}
        mine = ((n, weights.tp.shard(n, t)) for n, t in adapters.items() if any(n.startswith(h) for h in held))
        self.rollout.load_adapters(mine, scaling)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def held(self) -> dict:
        engine = self.rollout.engine
        return {
            "layers": list(engine.weights.held_layers),
            "input_norm": [layer.input_norm.clone() for layer in engine.weights.layers],
            "cache_bytes": engine.cache.nbytes() if engine.cache is not None else 0,
        }


@pytest.fixture(scope="module", params=[("tiny-llama", 1), ("tiny-qwen3-moe", 1), ("tiny-olmoe", 2)], ids=str)
def staged(request, local_ray):
    name, tg = request.param
    pool = RayResourcePool([PG * tg])
    group = RayWorkerGroup(pool, RoleSpec(StagedGenerator, kwargs={"name": name, "tg": tg}))
    model = load_causal_lm(name, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(name)
    single = NativeRollout(model, tokenizer, engine_config=engine_config())
    yield model, tokenizer, single, group
    pool.release()


@pytest.mark.parametrize("params", [greedy(12), sampled(seed=3, max_new_tokens=12, temperature=0.8, top_p=0.9)])
def test_stages_generate_what_one_process_does(staged, params):
    model, tokenizer, single, group = staged
    if model.config.model_type != "llama":
        params = dataclasses.replace(params, record_routes=True)
    prompts = prompts_of(tokenizer, QUESTIONS * 2)
    expected = single.generate_sequences(prompts, params).batch
    outputs = group.generate(prompts, params)
    assert len(outputs) == group.world_size
    for output in outputs:  # every rank produces the whole output
        assert torch.equal(output[RESPONSES], expected[RESPONSES])
        torch.testing.assert_close(output[ROLLOUT_LOG_PROBS], expected[ROLLOUT_LOG_PROBS], rtol=1e-5, atol=1e-5)
        if params.record_routes:  # every layer's experts, the stages' own filled in by each
            assert torch.equal(output[ROUTED_EXPERTS], expected[ROUTED_EXPERTS])


def test_each_stage_holds_its_layers_and_their_cache(staged):
    model, tokenizer, single, group = staged
    prompts = prompts_of(tokenizer, QUESTIONS * 2)
    single.generate_sequences(prompts, greedy(12))
    group.generate(prompts, greedy(12))
    layers = model.config.num_hidden_layers
    tg = group.world_size // PG
    for rank, held in enumerate(group.held()):
        stage = rank // tg
        assert held["layers"] == list(range(stage * layers // PG, (stage + 1) * layers // PG))
        for index, norm in zip(held["layers"], held["input_norm"]):
            torch.testing.assert_close(norm, model.model.layers[index].input_layernorm.weight, rtol=0, atol=0)
        assert held["cache_bytes"] == single.engine.cache.nbytes() // (PG * tg)


def test_served_adapters_on_each_stage_match_one_process(staged):
    """LoRA adapters on q/v of every layer, each stage serving its own layers': the group generates what one process
    does, which differs from the base policy's."""
    model, tokenizer, single, group = staged
    prompts = prompts_of(tokenizer, QUESTIONS * 2)
    base = single.generate_sequences(prompts, greedy(12)).batch[ROLLOUT_LOG_PROBS]
    peft_model = lora_model(copy.deepcopy(model), targets=["q_proj", "v_proj"]).eval()
    adapters, scaling = dict(adapter_tensors(peft_model)), lora_scaling(peft_model)
    single.load_adapters(adapters.items(), scaling)
    group.load_adapters(adapters, scaling)
    expected = single.generate_sequences(prompts, greedy(12)).batch
    assert (expected[ROLLOUT_LOG_PROBS] - base).abs().max() > 1e-2
    for output in group.generate(prompts, greedy(12)):
        assert torch.equal(output[RESPONSES], expected[RESPONSES])
        torch.testing.assert_close(output[ROLLOUT_LOG_PROBS], expected[ROLLOUT_LOG_PROBS], rtol=1e-5, atol=1e-5)
    single.load_adapters([], scaling)
    group.load_adapters({}, scaling)


def test_stages_that_do_not_divide_the_layers_are_refused():
    spec = spec_from_config(load_causal_lm("tiny-llama", dtype=torch.float32).config)  # 2 layers
    with pytest.raises(ValueError, match=r"2 decoder layers do not split into 3 .*rollout.pipeline_model_parallel"):
        PipelineStageGroup(size=3).local_spec(spec)
    assert PipelineStageGroup(size=2, rank=1).held_layers(3) == range(3, 6)
