"""Pipeline parallelism (engine/pipeline.py) against one process, fp32, gloo, Ray ranks: the actor's log-prob pass and
two optimizer steps of its update, with the model split into 2 stages (1F1B), 4 stages on 2 ranks (interleaved 1F1B),
and composed with FSDP2 (pp 2 x dp 2), tensor parallelism (pp 2 x tp 2) and Ulysses (pp 2 x sp 2: each stage's
slice of a micro-batch's tokens goes to the next stage's rank of its sp index), for two families (tiny-llama;
tiny-qwen2, whose head shares the embedding's weight: the first and the last stage each hold a copy, kept equal),
and a mixture of experts with its routers' balancing loss (tiny-qwen3-moe). Log-probs, the loss, the gradient norm
(the balancing loss and the expert loads) and every parameter after the steps equal the unsplit model's (relative
1e-5)."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from hybridflow.batch_keys import (
    ADVANTAGES,
    ATTENTION_MASK,
    INPUT_IDS,
    METRICS,
    OLD_LOG_PROBS,
    POSITION_IDS,
    RESPONSE_MASK,
    RESPONSES,
    ROUTED_EXPERTS,
)
from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register
from hybridflow.engine.checkpoint import load_training_state, save_training_state
from hybridflow.engine.pipeline import PipelinedModel, pipeline_mesh
from hybridflow.engine.policy import PolicyEngine
from hybridflow.engine.tensor_parallel import training_mesh
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.workers.sharded_model import RoleMeshes, build_trainable

LAYERS = 4  # 4 stages of one layer each under interleaved 1F1B on 2 ranks
ROWS = 8  # per data-parallel rank: 2 mini-batches of 4 rows, micro-batches of 2 (2 per stage and step)


def model_dir(family: str) -> str:
    return str(resolve_model_path(family, num_hidden_layers=LAYERS))


def rollout(vocab: int, rows: int, seed: int = 0) -> DataProto:
    """Rows of different prompt and response lengths (two pairs share a prompt), with advantages."""
    generator = torch.Generator().manual_seed(seed)
    width_p, width_r = 7, 6
    ids = torch.zeros(rows, width_p + width_r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(rows):
        prompt, answer = 2 + row % 5, 1 + (row * 3) % width_r
        if row % 4 == 1:  # the row before's prompt
            prompt = 2 + (row - 1) % 5
            ids[row, :width_p] = ids[row - 1, :width_p]
        else:
            ids[row, width_p - prompt : width_p] = torch.randint(3, vocab, (prompt,), generator=generator)
        ids[row, width_p : width_p + answer] = torch.randint(3, vocab, (answer,), generator=generator)
        mask[row, width_p - prompt : width_p + answer] = 1
    response_mask = mask[:, width_p:]
    advantages = torch.randn(response_mask.shape, generator=generator) * response_mask
    columns = {
        INPUT_IDS: ids,
        ATTENTION_MASK: mask,
        POSITION_IDS: (mask.cumsum(dim=1) - 1).clamp(min=0),
        RESPONSES: ids[:, width_p:],
        RESPONSE_MASK: response_mask,
        ADVANTAGES: advantages,
    }
    return DataProto.from_dict(columns)


LORA = ("actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8")


def actor_config(path: str, actor_config_factory, micro_batch: int = 2, *extra: str):
    micro_batches = [
        f"actor_rollout_ref.actor.{key}_micro_batch_size_per_gpu={micro_batch}" for key in ("ppo", "log_prob")
    ]
    return actor_config_factory(path, 1e-2, "actor_rollout_ref.actor.use_remove_padding=true", *micro_batches, *extra)


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, whole, under the unsplit model's names."""
    parts = model.stages if isinstance(model, PipelinedModel) else [model]
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for part in parts
        for name, p in part.named_parameters()
    }


class PipelineActor(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def build(self, config, dp: int, pp: int, tp: int, stages_per_rank: int, sp: int = 1) -> None:
        self.mesh = pipeline_mesh(self.device, dp, pp, tp) if pp > 1 else training_mesh(self.device, dp, tp)
        self.rows = self.mesh
        sp_group = None
        if sp > 1:  # (dp x sp, pp, tp) for FSDP2 and the stages, (dp, sp, pp, tp) for the rows
            meshes = RoleMeshes.build(self.device, LayoutShape(dp=dp, t=tp, tg=1, sp=sp, pp=pp))
            self.mesh, self.rows, sp_group = meshes.training, meshes.rows, meshes.sp_group
        trained = build_trainable(
            load_causal_lm,
            config.model.path,
            config.model,
            config.actor.fsdp,
            config.actor.optim,
            self.device,
            0,
            10,
            self.mesh,
            stages_per_rank,
        )
        self.actor = PolicyEngine(trained, config.actor, dp_group=self.rows["dp"].get_group(), sp_group=sp_group)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def log_probs_and_update(self, batch: DataProto) -> tuple[torch.Tensor, dict, dict, torch.Tensor | None]:
        """This dp rank's rows: their old log-probs, then the update (2 optimizer steps) on them; the metrics, every
        parameter after it, and the experts the old-log-prob pass routed each token to (R2, which the update
        replays; None without routing replay)."""
        dp_mesh = self.rows["dp"]
        rows = batch.chunk(dp_mesh.size())[dp_mesh.get_local_rank()]
        old = self.actor.compute_log_prob(rows, temperature=1.0, with_entropy=False).batch
        rows.batch[OLD_LOG_PROBS] = old[OLD_LOG_PROBS]
        routes = old[ROUTED_EXPERTS] if ROUTED_EXPERTS in old.keys() else None
        if routes is not None:
            rows.batch[ROUTED_EXPERTS] = routes
        metrics = self.actor.update_policy(rows, mini_batch_size=len(rows) // 2, temperature=1.0, seed=0)
        return old[OLD_LOG_PROBS], metrics.meta_info[METRICS], full_parameters(self.actor.model), routes

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save(self, directory: str) -> None:
        save_training_state(Path(directory), self.actor.trained, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load(self, directory: str) -> dict[str, torch.Tensor]:
        load_training_state(Path(directory), self.actor.trained, self.rank)
        return full_parameters(self.actor.model)


@pytest.fixture(scope="module")
def groups(local_ray):
    """Groups of 1 (the unsplit reference), 2 and 4 ranks, started side by side."""
    pools = {size: RayResourcePool([size]) for size in (1, 2, 4)}
    with ThreadPoolExecutor(3) as threads:
        starting = {size: threads.submit(RayWorkerGroup, pool, RoleSpec(PipelineActor)) for size, pool in pools.items()}
    made = {size: start.result() for size, start in starting.items()}
    yield made
    for pool in pools.values():
        pool.release()


LAYOUTS = {  # name: (dp, pp, tp, stages per rank, rows per micro-batch[, sp])
    "pp2-1f1b": (1, 2, 1, 1, 2),
    "pp2-interleaved": (1, 2, 1, 2, 2),
    "pp2-dp2": (2, 2, 1, 1, 2),
    "pp2-tp2": (1, 2, 2, 1, 2),
    "pp2-dp2-interleaved": (2, 2, 1, 2, 2),
    # one micro-batch per optimizer step, fewer than the stages: an empty one makes up the schedule's count
    "pp2-one-micro-batch": (1, 2, 1, 1, 4),
    "pp2-interleaved-3-micro-batches": (1, 2, 1, 2, 3),
    "pp2-sp2": (1, 2, 1, 1, 2, 2),
    "pp2-sp2-interleaved": (1, 2, 1, 2, 2, 2),
}


def one_process_order(batch: DataProto, dp: int) -> tuple[DataProto, list[torch.Tensor]]:
    """``batch``'s rows ordered so that one process's two mini-batches hold what dp ranks' k-th mini-batches hold
    together, and where each dp rank's rows lie in that order."""
    half = ROWS // 2
    order = [d * ROWS + k * half + i for k in range(2) for d in range(dp) for i in range(half)]
    where = [torch.tensor([order.index(d * ROWS + j) for j in range(ROWS)]) for d in range(dp)]
    ordered = batch.select(deepcopy=True)
    ordered.reorder(order)
    return ordered, where


def tied_copy(name: str) -> str:
    """The unsplit model's name of a tied head's weight: the embedding's (under LoRA, with peft's prefix)."""
    return name.replace("lm_head.weight", "model.embed_tokens.weight")


# both families in the four layouts the design names (1F1B, interleaved, with d = 2 and with t = 2); the schedules'
# edge cases and LoRA on one family (what differs between the families, qwen2's attention biases, is in the four)
CASES = (
    [(family, layout) for family in ("tiny-llama", "tiny-qwen2") for layout in list(LAYOUTS)[:4]]
    + [("tiny-llama", layout) for layout in [*list(LAYOUTS)[4:], "pp2-1f1b-lora", "pp2-tp2-lora"]]
    + [("tiny-qwen2", "pp2-sp2")]
)
# a mixture of experts with its routers' balancing loss (weight 0.5): every stage adds its layers' routing statistics
# to what it sends on, the last computes the loss, whose gradient reaches each stage's routers back through the sends
BALANCED = ("actor_rollout_ref.actor.router_aux_loss_coef=0.5",)
CASES += [
    ("tiny-qwen3-moe", f"{layout}-balanced")
    for layout in ("pp2-1f1b", "pp2-interleaved", "pp2-dp2", "pp2-one-micro-batch", "pp2-sp2", "pp2-tp2")
]
# R2: the old-log-prob pass records the experts of every token in every layer, each stage adding its layers' columns
# to what it sends on; the update replays them in each stage
R2 = ("actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.router_aux_loss_coef=0")
CASES += [("tiny-qwen3-moe", f"{layout}-r2") for layout in ("pp2-1f1b", "pp2-dp2-interleaved", "pp2-sp2")]


# the fast tier: each schedule, composition and variant once (the tied head on tiny-qwen2); the slow tier: the rest
FAST = {
    ("tiny-llama", "pp2-1f1b"),
    ("tiny-llama", "pp2-interleaved"),
    ("tiny-llama", "pp2-dp2"),
    ("tiny-llama", "pp2-tp2"),
    ("tiny-llama", "pp2-sp2"),
    ("tiny-llama", "pp2-1f1b-lora"),
    ("tiny-qwen2", "pp2-1f1b"),
    ("tiny-qwen3-moe", "pp2-1f1b-balanced"),
    ("tiny-qwen3-moe", "pp2-1f1b-r2"),
}
assert FAST <= set(CASES)


@pytest.mark.parametrize(
    "family, layout", [case if case in FAST else pytest.param(*case, marks=pytest.mark.slow) for case in CASES]
)
def test_pipeline_stages_give_the_unsplit_log_probs_loss_gradient_norm_and_parameters(
    groups, family, layout, actor_config_factory
):
    """With LoRA (rank 4 on every linear layer): the adapters train, the frozen base stays, in stages as unsplit."""
    variant = next((v for v in ("-lora", "-balanced", "-r2") if layout.endswith(v)), "")
    lora, balanced, recorded = variant == "-lora", variant == "-balanced", variant == "-r2"
    dp, pp, tp, stages_per_rank, micro_batch, *split = LAYOUTS[layout.removesuffix(variant)]
    sp = split[0] if split else 1
    extra = {"-lora": LORA, "-balanced": BALANCED, "-r2": R2}.get(variant, ())
    config = actor_config(model_dir(family), actor_config_factory, micro_batch, *extra)
    ulysses = f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}"
    split_config = actor_config(model_dir(family), actor_config_factory, micro_batch, *extra, ulysses)
    batch = rollout(load_causal_lm(config.model.path).config.vocab_size, ROWS * dp)
    ordered, where = one_process_order(batch, dp)
    groups[1].build(config, 1, 1, 1, 1)
    [(want_log_probs, want_metrics, want_parameters, want_routes)] = groups[1].log_probs_and_update(ordered)
    staged = groups[dp * sp * pp * tp]
    staged.build(split_config, dp, pp, tp, stages_per_rank, sp)
    results = staged.log_probs_and_update(batch)
    keys = ["actor/pg_loss", "actor/grad_norm"]
    if balanced:  # the balancing loss and each layer's busiest expert, as the unsplit model's
        keys += [key for key in want_metrics if key.startswith(("actor/router_aux_loss", "actor/expert_load_max/"))]
        assert len(keys) == 2 + 1 + LAYERS and want_metrics["actor/router_aux_loss"] > 0
    for key in keys:  # the driver's mean over ranks is the mini-batch's
        assert sum(r[1][key] for r in results) / len(results) == pytest.approx(want_metrics[key], rel=1e-5), key
    for rank, (log_probs, _, parameters, routes) in enumerate(results):
        mine = where[rank // (sp * pp * tp)]  # the rows of this rank's dp index
        torch.testing.assert_close(log_probs, want_log_probs[mine], rtol=1e-5, atol=1e-6)
        if recorded:  # every stage's layers' columns, as the unsplit pass routed them
            assert routes.shape == want_routes[mine].shape and bool((routes >= 0).any())
            assert torch.equal(routes, want_routes[mine])
        for name, value in parameters.items():  # a tied head is the embedding's copy
            want = want_parameters.get(name, want_parameters.get(tied_copy(name)))
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)
    held = {name for _, _, parameters, _ in results for name in parameters}
    assert set(want_parameters) <= held  # every parameter is on some stage
    if lora:  # the adapters moved
        assert any("lora_A" in name for name in held)


def assert_same_parameters(results: list[dict], want: dict) -> None:
    for parameters in results:
        for name, value in parameters.items():  # a tied head is the embedding's copy
            torch.testing.assert_close(value, want.get(name, want.get("model.embed_tokens.weight")), msg=name)


@pytest.mark.parametrize("family", ["tiny-llama"])
def test_a_checkpoint_saved_with_stages_resumes_without_them_and_the_reverse(
    groups, family, actor_config_factory, tmp_path
):
    """Saved at pp 2 (1F1B), loaded on one process: the same weights, and the next update (its optimizer state
    restored) gives the same weights as the staged run's; saved there, loaded at pp 2 interleaved, likewise."""
    config = actor_config(model_dir(family), actor_config_factory)
    vocab = load_causal_lm(config.model.path).config.vocab_size
    first, second, third = (rollout(vocab, ROWS, seed) for seed in range(3))
    staged, single = groups[2], groups[1]
    staged.build(config, 1, 2, 1, 1)
    saved = {
        name: value for _, _, parameters, _ in staged.log_probs_and_update(first) for name, value in parameters.items()
    }
    staged.save(str(tmp_path / "staged"))
    continued = staged.log_probs_and_update(second)
    single.build(config, 1, 1, 1, 1)
    assert_same_parameters(single.load(str(tmp_path / "staged")), saved)
    [(_, _, resumed, _)] = single.log_probs_and_update(second)
    assert_same_parameters([r[2] for r in continued], resumed)
    single.save(str(tmp_path / "single"))
    [(_, _, after, _)] = single.log_probs_and_update(third)
    staged.build(config, 1, 2, 1, 2)
    assert_same_parameters(staged.load(str(tmp_path / "single")), resumed)
    assert_same_parameters([r[2] for r in staged.log_probs_and_update(third)], after)
