"""The native engine tensor-parallel over 2 gloo ranks (tg=2) against one process (tg=1), fp32.

Each rank holds half of every decoder layer and of the KV cache (a mixture's: half of its experts, whole); the
tokens must be the same and the log-probs equal to rounding (the row-parallel sums are added in another order)."""

import copy

import pytest
import torch
import torch.distributed as dist
from lora_helpers import EXPERTS, lora_model
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of, sampled

from hybridflow.batch_keys import RESPONSES, ROLLOUT_LOG_PROBS
from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register
from hybridflow.engine.lora import adapter_tensors, lora_scaling
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.models.tensor_parallel import LLAMA, layer_split
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.parallel import TensorParallelGroup

TG = 2


class TensorParallelGenerator(Worker):
    def __init__(self, *, name: str):
        super().__init__()
        torch.set_num_threads(1)
        model = load_causal_lm(name, dtype=torch.float32).eval()
        self.rollout = NativeRollout(
            model, load_tokenizer(name), engine_config=engine_config(), tp_group=dist.group.WORLD
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate(self, prompts, params) -> dict[str, torch.Tensor]:
        output = self.rollout.generate_sequences(prompts, params)
        return {key: output.batch[key] for key in (RESPONSES, ROLLOUT_LOG_PROBS)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_adapters(self, adapters: dict[str, torch.Tensor], scaling: float) -> None:
        """Serve whole adapters, each as this rank's slice (what a transfer sends it)."""
        tp = self.rollout.engine.weights.tp
        self.rollout.load_adapters(((name, tp.shard(name, t)) for name, t in adapters.items()), scaling)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def held(self) -> dict:
        """What this rank holds: its first layer's matrices, its weight and KV-cache bytes."""
        engine = self.rollout.engine
        layer = engine.weights.layers[0]
        mlp = layer.experts or layer  # a mixture's experts (E', 2I, H) and (E', H, I), or the dense MLP's matrices
        return {
            "qkv": layer.qkv.weight.clone(),
            "qkv_bias": None if layer.qkv.bias is None else layer.qkv.bias.clone(),
            "o": layer.o.weight.clone(),
            "gate_up": getattr(mlp.gate_up, "weight", mlp.gate_up).clone(),
            "down": getattr(mlp.down, "weight", mlp.down).clone(),
            "weight_bytes": engine.weights.nbytes(),
            "cache_bytes": engine.cache.nbytes() if engine.cache is not None else 0,
        }


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-qwen3-moe", "tiny-olmoe"])
def family(request, local_ray):
    pool = RayResourcePool([TG])
    group = RayWorkerGroup(pool, RoleSpec(TensorParallelGenerator, kwargs={"name": request.param}))
    model = load_causal_lm(request.param, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(request.param)
    single = NativeRollout(model, tokenizer, engine_config=engine_config())
    yield model, tokenizer, single, group
    pool.release()


@pytest.mark.parametrize("params", [greedy(12), sampled(seed=3, max_new_tokens=12, temperature=0.8, top_p=0.9)])
def test_tensor_parallel_generation_matches_one_process(family, params):
    model, tokenizer, single, group = family
    prompts = prompts_of(tokenizer, QUESTIONS * 2)
    expected = single.generate_sequences(prompts, params)
    for output in group.generate(prompts, params):  # both ranks produce the whole output
        assert torch.equal(output[RESPONSES], expected.batch[RESPONSES])
        torch.testing.assert_close(output[ROLLOUT_LOG_PROBS], expected.batch[ROLLOUT_LOG_PROBS], rtol=1e-5, atol=1e-5)


def test_each_rank_holds_its_slice_and_half_the_cache(family):
    model, tokenizer, single, group = family
    prompts = prompts_of(tokenizer, QUESTIONS * 2)
    single.generate_sequences(prompts, greedy(12))
    group.generate(prompts, greedy(12))  # the group's cache, of the same shape as the single process's
    params = dict(model.named_parameters())
    prefix = "model.layers.0."

    split = layer_split(model.config.model_type)

    def piece(name: str, rank: int) -> torch.Tensor:
        return TensorParallelGroup(split, size=TG, rank=rank).shard(prefix + name, params[prefix + name].detach())

    full_weights = single.engine.weights.nbytes()
    split_bytes = sum(t.numel() * 4 for n, t in params.items() if split.shard_dim(n) is not None)
    for rank, held in enumerate(group.held()):
        qkv = torch.cat([piece(f"self_attn.{p}_proj.weight", rank) for p in "qkv"])
        torch.testing.assert_close(held["qkv"], qkv, rtol=0, atol=0)
        if held["qkv_bias"] is not None:
            bias = torch.cat([piece(f"self_attn.{p}_proj.bias", rank) for p in "qkv"])
            torch.testing.assert_close(held["qkv_bias"], bias, rtol=0, atol=0)
        torch.testing.assert_close(held["o"], piece("self_attn.o_proj.weight", rank), rtol=0, atol=0)
        if prefix + "mlp.experts.down_proj" in params:  # each rank holds its half of the experts, whole
            experts = params[prefix + "mlp.experts.down_proj"].shape[0]
            own = slice(rank * experts // TG, (rank + 1) * experts // TG)
            for name in ("gate_up", "down"):
                whole = params[f"{prefix}mlp.experts.{name}_proj"].detach()
                torch.testing.assert_close(held[name], whole[own], rtol=0, atol=0)
        else:
            gate_up = torch.cat([piece("mlp.gate_proj.weight", rank), piece("mlp.up_proj.weight", rank)])
            torch.testing.assert_close(held["gate_up"], gate_up, rtol=0, atol=0)
            torch.testing.assert_close(held["down"], piece("mlp.down_proj.weight", rank), rtol=0, atol=0)
        assert held["weight_bytes"] == full_weights - split_bytes // TG  # the projections halved, the rest whole
        assert held["cache_bytes"] == single.engine.cache.nbytes() // TG


def test_a_row_parallel_bias_is_held_by_rank_0_only():
    assert not TensorParallelGroup(LLAMA, size=2, rank=1).holds("model.layers.0.self_attn.o_proj.bias")
    assert TensorParallelGroup(LLAMA, size=2, rank=0).holds("model.layers.0.self_attn.o_proj.bias")
    assert TensorParallelGroup(LLAMA, size=2, rank=1).holds("model.layers.0.self_attn.q_proj.bias")
    assert TensorParallelGroup(LLAMA, size=2, rank=1).holds("model.layers.0.self_attn.o_proj.weight")


def test_a_size_that_splits_heads_is_refused():
    model = load_causal_lm("tiny-llama", dtype=torch.float32)  # 4 query heads, 2 key/value heads
    from hybridflow.rollout.native.spec import spec_from_config

    with pytest.raises(ValueError, match=r"rollout.tensor_model_parallel_size=4 .*'num_key_value_heads': 2"):
        TensorParallelGroup(LLAMA, size=4, rank=0).local_spec(spec_from_config(model.config))


def test_a_size_that_splits_a_mixture_s_experts_unevenly_is_refused():
    from hybridflow.models.tensor_parallel import MIXTURE
    from hybridflow.rollout.native.spec import spec_from_config

    spec = spec_from_config(load_causal_lm("tiny-olmoe", dtype=torch.float32).config)  # 4 experts
    with pytest.raises(ValueError, match=r"rollout.tensor_model_parallel_size=3 .*'num_experts': 4"):
        TensorParallelGroup(MIXTURE, size=3, rank=0).local_spec(spec)
    assert TensorParallelGroup(MIXTURE, size=2, rank=1).experts(4) == range(2, 4)


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-olmoe"], indirect=True)
def test_served_adapters_on_attention_and_each_expert_match_one_process(family):
    """A LoRA policy with adapters on q/v and on every expert (peft's target_parameters), served: each rank takes its
    slice of the attention's adapters and its own experts' rows of theirs, and the group generates what one process
    does, which differs from the base policy's."""
    model, tokenizer, single, group = family
    prompts = prompts_of(tokenizer, QUESTIONS * 2)
    base = single.generate_sequences(prompts, greedy(12)).batch[ROLLOUT_LOG_PROBS]
    peft_model = lora_model(copy.deepcopy(model), targets=["q_proj", "v_proj"], parameters=EXPERTS).eval()
    adapters, scaling = dict(adapter_tensors(peft_model)), lora_scaling(peft_model)
    assert any(".experts." in name for name in adapters)
    single.load_adapters(adapters.items(), scaling)
    group.load_adapters(adapters, scaling)
    expected = single.generate_sequences(prompts, greedy(12)).batch
    assert (expected[ROLLOUT_LOG_PROBS] - base).abs().max() > 1e-2  # the adapters change the policy
    for output in group.generate(prompts, greedy(12)):
        assert torch.equal(output[RESPONSES], expected[RESPONSES])
        torch.testing.assert_close(output[ROLLOUT_LOG_PROBS], expected[ROLLOUT_LOG_PROBS], rtol=1e-5, atol=1e-5)
    single.load_adapters([], scaling)  # the module's later tests see the base policy
    group.load_adapters({}, scaling)
