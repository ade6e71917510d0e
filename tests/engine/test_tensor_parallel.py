"""A training step in the (dp, tp) layout against one unsharded process (fp32, gloo, Ray ranks). One group of 2
ranks and one of 4 serve every layout in turn (each case builds its mesh and model anew): starting a rank's
process is most of this file's time."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from lora_helpers import EXPERTS, lora_model
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register
from hybridflow.engine.fsdp import grad_norm_and_clip, shard_model
from hybridflow.engine.tensor_parallel import apply_tensor_parallel, decoder_layer_plan, training_mesh
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.models.routing import experts_modules
from hybridflow.models.split_sizes import check_tensor_parallel_size
from hybridflow.models.tensor_parallel import layer_split
from hybridflow.trainer.setup.config import default_config

FP32 = dataclasses.replace(default_config().actor_rollout_ref.actor.fsdp, param_dtype="fp32", reduce_dtype="fp32")


def token_log_probs(model, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (4, 9), generator=generator)
    weights = torch.rand((4, 8), generator=generator)  # per-token weights: a stand-in for A * mask
    return input_ids, weights


def load(path: str, lora: bool) -> torch.nn.Module:
    """The tiny model, seeded; with ``lora``, adapters of rank 4 on every linear layer (and a mixture's experts),
    B moved off zero so that A has gradients too (tests/lora_helpers.py)."""
    torch.manual_seed(0)
    model = load_causal_lm(path, dtype=torch.float32)
    if not lora:
        return model
    return lora_model(model, seed=1, parameters=EXPERTS if experts_modules(model) else None)


class ParallelStep(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def build(self, path: str, dp: int, tp: int, lora: bool) -> None:
        """The seeded model (with LoRA adapters if ``lora``) in the (dp, tp) layout over this group's ranks."""
        self.mesh = training_mesh(self.device, dp, tp)
        model = load(path, lora)
        apply_tensor_parallel(model, self.mesh["tp"])
        self.model = shard_model(model, self.mesh["dp"], FP32)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def loss_and_grads(self, input_ids: torch.Tensor, weights: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        """The whole batch's loss -Σ w·log p / Σ w, its rows split over dp; tp peers share rows."""
        dp_mesh = self.mesh["dp"]
        dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
        rows = slice(dp_rank * len(input_ids) // dp, (dp_rank + 1) * len(input_ids) // dp)
        share = -(weights[rows] * token_log_probs(self.model, input_ids[rows])).sum() / weights.sum()
        (share * dp).backward()  # FSDP averages gradients over dp: the sum of the shares' gradients
        loss = share.detach().clone()
        dist.all_reduce(loss, group=dp_mesh.get_group())
        grads = {name: p.grad.full_tensor() for name, p in self.model.named_parameters() if p.requires_grad}
        return float(loss), grads

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def clip(self, max_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
        """grad_norm_and_clip on this layout's gradients (on two meshes: the split layers' (dp, tp), the rest's dp):
        the norm it returns and every gradient after it, whole."""
        norm = grad_norm_and_clip(self.model, max_norm)
        return norm, {name: p.grad.full_tensor() for name, p in self.model.named_parameters() if p.requires_grad}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def local_numel(self, name: str) -> int:
        """Elements of parameter ``name`` this rank holds (its shard)."""
        return dict(self.model.named_parameters())[name].to_local().numel()


def one_process(path: str, lora: bool):
    model = load(path, lora)
    input_ids, weights = batch(model.config.vocab_size)
    loss = -(weights * token_log_probs(model, input_ids)).sum() / weights.sum()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads, (input_ids, weights)


@pytest.fixture(scope="module")
def groups(local_ray):
    """Groups of 2 and of 4 ranks, started side by side."""
    pools = {size: RayResourcePool([size]) for size in (2, 4)}
    with ThreadPoolExecutor(2) as threads:
        starting = {size: threads.submit(RayWorkerGroup, pool, RoleSpec(ParallelStep)) for size, pool in pools.items()}
    made = {size: start.result() for size, start in starting.items()}
    yield made
    for pool in pools.values():
        pool.release()


@pytest.mark.parametrize("dp, tp, lora", [(2, 1, False), (1, 2, False), (2, 2, False), (1, 2, True), (2, 2, True)])
def test_a_step_in_the_training_layout_matches_one_process(groups, tiny_path, dp, tp, lora):
    """With LoRA: the adapters' gradients (all that trains) split with their layers, as one process's."""
    group = groups[dp * tp]
    loss, grads, (input_ids, weights) = one_process(tiny_path, lora)
    group.build(tiny_path, dp, tp, lora)
    if lora:  # a column-split layer's B and a row-split layer's A split over both; the other over dp only
        prefix = "base_model.model.model.layers.0"
        for name, split in [
            ("self_attn.q_proj.lora_B", dp * tp),
            ("self_attn.q_proj.lora_A", dp),
            ("mlp.down_proj.lora_A", dp * tp),
            ("mlp.down_proj.lora_B", dp),
        ]:
            full = f"{prefix}.{name}.default.weight"
            assert group.local_numel(full) == [grads[full].numel() // split] * (dp * tp), name
    else:
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        assert group.local_numel(q_proj) == [grads[q_proj].numel() // (dp * tp)] * (dp * tp)  # sharded over both
    _equal_to_one_process(group, loss, grads, input_ids, weights)


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 2)])
def test_clipping_in_the_training_layout_is_one_process_s(groups, tiny_path, dp, tp):
    """The global norm over gradients on two meshes; below the limit nothing changes, above it every gradient is
    scaled by max_norm / (norm + 1e-6), bit for bit on each rank, and as one process clips."""
    group = groups[dp * tp]
    _, grads, (input_ids, weights) = one_process(tiny_path, False)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()])).item()
    group.build(tiny_path, dp, tp, False)
    before = [rank_grads for _, rank_grads in group.loss_and_grads(input_ids, weights)]
    for (norm, after), rank_before in zip(group.clip(10 * expected), before):  # below the limit
        assert norm == pytest.approx(expected, rel=1e-5)
        assert all(torch.equal(after[name], grad) for name, grad in rank_before.items())
    max_norm = expected / 4
    for (norm, after), rank_before in zip(group.clip(max_norm), before):
        assert norm == pytest.approx(expected, rel=1e-5)
        coefficient = max_norm / (norm + 1e-6)
        for name, grad in rank_before.items():
            assert torch.equal(after[name], grad * coefficient), name
            torch.testing.assert_close(after[name], grads[name] * (max_norm / expected), rtol=1e-4, atol=1e-6)


def _equal_to_one_process(group, loss: float, grads: dict, input_ids: torch.Tensor, weights: torch.Tensor) -> None:
    for rank_loss, rank_grads in group.loss_and_grads(input_ids, weights):
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        assert rank_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(rank_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# one case a family in the fast tier (Qwen3-MoE's per-head norms with LoRA on its experts, OLMoE's all-head norms,
# Mixtral's plain layer), the other six in the slow tier
FAST_MOE = {("tiny-qwen3-moe", 2, 2, True), ("tiny-olmoe", 2, 2, False), ("tiny-mixtral", 1, 2, False)}
MOE_CASES = [
    pytest.param(model, *case, marks=() if (model, *case) in FAST_MOE else pytest.mark.slow)
    for model in ("tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe")
    for case in ((1, 2, False), (2, 2, False), (2, 2, True))
]


@pytest.mark.parametrize("model, dp, tp, lora", MOE_CASES)
def test_a_mixture_s_experts_split_between_tp_ranks_train_as_one_process(groups, model, dp, tp, lora):
    """Each tp rank holds half of every MoE layer's experts (and FSDP2 half of that over dp); with LoRA on the
    experts too, their adapters whole on every rank: loss and every trained gradient as one process's."""
    path = str(resolve_model_path(model))
    group = groups[dp * tp]
    loss, grads, (input_ids, weights) = one_process(path, lora)
    group.build(path, dp, tp, lora)
    prefix = "base_model.model.model.layers.0.mlp.experts" if lora else "model.layers.0.mlp.experts"
    gate_up = f"{prefix}.base_layer.base_layer.gate_up_proj" if lora else f"{prefix}.gate_up_proj"
    whole = load_causal_lm(path, dtype=torch.float32).model.layers[0].mlp.experts.gate_up_proj.numel()
    assert group.local_numel(gate_up) == [whole // (dp * tp)] * (dp * tp)  # split by expert, then by FSDP2
    if lora:  # the experts' adapters whole on each tp rank, sharded over dp
        adapters = [name for name in grads if ".experts." in name]
        assert len(adapters) == 2 * 2 * 2  # A and B of both expert weights in both layers
        for name in adapters:
            assert group.local_numel(name) == [grads[name].numel() // dp] * (dp * tp), name
    _equal_to_one_process(group, loss, grads, input_ids, weights)


def test_a_layout_that_splits_heads_is_refused(tiny_path):
    config = load_causal_lm(tiny_path, dtype=torch.float32).config  # 4 query heads, 2 key/value heads
    check_tensor_parallel_size(config, 2, "actor.tensor_model_parallel_size")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tensor_parallel_size(config, 4, "actor.tensor_model_parallel_size")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_the_plan_is_megatrons_split_of_a_decoder_layer(model_type):
    plan = decoder_layer_plan(layer_split(model_type))
    column = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
    assert {name: type(style) for name, style in plan.items()} == {
        **dict.fromkeys(column, ColwiseParallel),
        "self_attn.o_proj": RowwiseParallel,
        "mlp.down_proj": RowwiseParallel,
    }
