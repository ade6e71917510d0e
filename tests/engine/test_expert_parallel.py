"""Expert parallelism (engine/expert_parallel.py) on 4 gloo ranks, data-parallel, against the same ranks with every
expert on every rank (ep = 1, transformers' own experts forward): ep = 2 (two replicas of each half of the experts)
and ep = 4 (one expert per rank) give the same log-probs, gradients (relative 1e-5), parameters after 2 optimizer
steps of the actor's update and weights gathered by the switch to generation, fp32, for three MoE families (Qwen3-MoE
with tied embeddings, OLMoE, and Mixtral: tiny-llama upcycled, whose experts start equal), for Qwen3-MoE with LoRA on
its experts (each rank adds the adapters of the experts it holds), and for a model whose first layer sends every token
to the same two experts, so that a rank receives no token at all. Qwen3-MoE's cases run in the fast tier, the other
families' in the slow tier (a second set of ranks)."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.batch_keys import ADVANTAGES, ATTENTION_MASK, INPUT_IDS, OLD_LOG_PROBS, POSITION_IDS, RESPONSE_MASK
from hybridflow.engine.expert_parallel import is_expert_weight
from hybridflow.engine.forward import response_log_probs
from hybridflow.engine.lora import adapters_off, is_lora
from hybridflow.engine.policy import PolicyEngine
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.reshard import SwitchReport, generation_weights
from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.models.routing import experts_modules
from hybridflow.models.upcycle import upcycle
from hybridflow.workers.sharded_model import build_trainable
from tests.conftest import fp32_actor_config

WORLD = 4
# each model's sizes: one expert per rank for two families, two a rank for every model
EP_SIZES = {"qwen3_moe": (1, 2, 4), "olmoe": (1, 2, 4), "one_pair": (1, 2), "mixtral": (1, 2), "lora": (1, 2)}
OTHER_FAMILIES = ("olmoe", "one_pair", "mixtral")  # run apart, in the slow tier (the fast tier's time)
# tiny-qwen3-moe with LoRA on q_proj and on every expert (peft's target_parameters): the adapters train, the base not
EXPERT_LORA = [
    "actor_rollout_ref.model.lora.rank=4",
    "actor_rollout_ref.model.lora.alpha=8",
    "actor_rollout_ref.model.lora.target_modules=[q_proj]",
    "actor_rollout_ref.model.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]",
]
ROWS = [0, 1, 2, 3, 4, 5, 1, 4]  # the 6 rows of the rollout batch and two again: 2 a rank


def _grads(model, share) -> dict[str, torch.Tensor]:
    """Whole gradients of the packed forward's log-probs, summed over every rank's rows (each rank's loss carries the
    data-parallel size, as the update's does)."""
    log_probs, _ = response_log_probs(model, share, remove_padding=True)
    (log_probs * share.batch[RESPONSE_MASK] * share.batch[ADVANTAGES]).sum().mul(WORLD).backward()
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        if grad is None:  # frozen (a LoRA model's base)
            continue
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
        parameter.grad = None
    return grads


def _run(rank: int, path: str, config, batch, ep: int) -> dict:
    actor = config.actor
    trained = build_trainable(
        load_causal_lm, path, config.model, actor.fsdp, actor.optim, torch.device("cpu"), 0, 10, expert_parallel=ep
    )
    split = [p for p in trained.model.parameters() if is_expert_weight(p)]
    share = batch.chunk(WORLD)[rank]
    grads = _grads(trained.model, share)
    engine = PolicyEngine(trained, actor)
    log_probs = engine.compute_log_prob(share, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
    metrics = [engine.update_policy(share, len(share), 1.0, seed=step).meta_info["metrics"] for step in range(2)]
    after = reference = None
    if is_lora(trained.model):  # after the updates, with the adapters and without them (the reference policy)
        after = engine.compute_log_prob(share, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
        with adapters_off(trained.model):
            reference = engine.compute_log_prob(share, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
    params = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in trained.model.named_parameters()
    }
    report = SwitchReport()  # the switch to generation: every weight whole on every rank
    generation = {
        name: tensor.clone() for name, tensor in generation_weights(trained.model, torch.float32, None, report)
    }
    switch = (report.received, report.predicted(LayoutShape(dp=WORLD, t=1, tg=1, ep=ep)), report.experts)
    return dict(
        split=len(split),
        log_probs=log_probs,
        after=after,
        reference=reference,
        grads=grads,
        metrics=metrics,
        params=params,
        generation=generation,
        switch=switch,
    )


def _ranks(rank: int, init_file: str, models: dict, batch, out: str, balancing: bool) -> None:
    # a collective that waits 5 minutes fails the test, instead of holding the suite (this test once hung when ranks
    # disagreed on whether a dropped model's shared-memory collectives still existed: host_collectives_for now agrees)
    timeout = datetime.timedelta(minutes=5)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        torch.set_num_threads(1)
        results = {}
        for name, path in models.items():
            extra = EXPERT_LORA if name == "lora" else []
            config = fp32_actor_config(path, 1e-2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *extra)
            results[name] = {ep: _run(rank, path, config, batch, ep) for ep in EP_SIZES[name]}
        # the balancing loss at a weight of 0.5 and at 0, each rank's 2 rows in one micro-batch
        whole = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
        for coefficient, sizes in ((0.5, (1, 2)), (0.0, (1,))) if balancing else ():
            extra = [*whole, f"actor_rollout_ref.actor.router_aux_loss_coef={coefficient}"]
            config = fp32_actor_config(models["qwen3_moe"], 1e-2, *extra)
            results[f"aux {coefficient}"] = {ep: _run(rank, models["qwen3_moe"], config, batch, ep) for ep in sizes}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _zero_first_router(tmp_path) -> str:
    """tiny-qwen3-moe with its first layer's router at zero: every token ties, and top-k takes the same two experts."""
    model = load_causal_lm(str(resolve_model_path("tiny-qwen3-moe")), dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.zero_()
    model.save_pretrained(tmp_path / "model")
    load_tokenizer(str(resolve_model_path("tiny-qwen3-moe"))).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def _spawn(directory, models: dict, batch, balancing: bool) -> list[dict]:
    out = str(directory / "results.pt")
    mp.spawn(_ranks, args=(str(directory / "init"), models, batch, out, balancing), nprocs=WORLD)
    return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def results(tmp_path_factory, rollout_batch) -> list[dict]:
    """Qwen3-MoE plain, with LoRA, and with the balancing loss."""
    path = str(resolve_model_path("tiny-qwen3-moe"))
    directory = tmp_path_factory.mktemp("expert_parallel")
    return _spawn(directory, {"qwen3_moe": path, "lora": path}, rollout_batch[ROWS], balancing=True)


@pytest.fixture(scope="module")
def other_families(tmp_path_factory, rollout_batch) -> list[dict]:
    """OLMoE, the model whose first router sends every token to two experts, and the upcycled Mixtral."""
    directory = tmp_path_factory.mktemp("expert_parallel_families")
    models = {
        "olmoe": str(resolve_model_path("tiny-olmoe")),
        "one_pair": _zero_first_router(directory),
        "mixtral": str(upcycle(resolve_model_path("tiny-llama"), directory / "mixtral", experts=4, top_k=2)),
    }
    return _spawn(directory, models, rollout_batch[ROWS], balancing=False)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp(min=1e-6)
    assert ((actual - expected).abs().max() / scale) < 1e-5, what


@pytest.mark.parametrize(
    "model, ep",
    [
        pytest.param(model, ep, marks=pytest.mark.slow if model in OTHER_FAMILIES else ())
        for model, sizes in EP_SIZES.items()
        for ep in sizes[1:]
    ],
)
def test_experts_split_over_ranks_train_as_on_every_rank(request, model, ep):
    runs = request.getfixturevalue("other_families" if model in OTHER_FAMILIES else "results")
    for rank, by_model in enumerate(runs):
        plain, split = by_model[model][1], by_model[model][ep]
        assert plain["split"] == 0 and split["split"] == 4  # gate_up_proj and down_proj of both layers
        _close(split["log_probs"], plain["log_probs"], f"rank {rank} log-probs")
        assert set(split["grads"]) == set(plain["grads"])
        for name, grad in plain["grads"].items():
            _close(split["grads"][name], grad, f"rank {rank} gradient of {name}")
        for step, (got, want) in enumerate(zip(split["metrics"], plain["metrics"], strict=True)):
            for key in ("actor/pg_loss", "actor/grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (rank, step, key)
        for name, value in plain["params"].items():
            _close(split["params"][name], value, f"rank {rank} parameter {name} after 2 steps")
        moved = [name for name, value in plain["params"].items() if "experts" in name]
        assert moved  # the expert weights are among those compared
        if model == "lora":  # what trains is the adapters, those of the experts among them
            trained = {name for name in plain["grads"] if "experts" in name}
            assert trained and all("lora_" in name for name in plain["grads"]), sorted(plain["grads"])
            assert len(trained) == 8  # A and B of gate_up_proj and down_proj, in 2 layers
            # B starts at 0: the first log-probs are the base model's, which the adapters switched off give again
            _close(split["reference"], plain["log_probs"], f"rank {rank} log-probs with the adapters off")
            _close(split["after"], plain["after"], f"rank {rank} log-probs after 2 steps")
            assert (split["after"] - split["reference"]).abs().max() > 1e-4  # the adapters moved them
        # the switch to generation gathers the split experts (over the ep ranks, each replica holding them all) into
        # the weights every rank generates with, and moves the bytes the prediction says
        assert split["generation"].keys() == plain["generation"].keys()
        for name, value in plain["generation"].items():
            _close(split["generation"][name], value, f"rank {rank} generation weight {name}")
        (received, predicted, experts), (_, _, no_experts) = split["switch"], plain["switch"]
        assert experts > 0 and no_experts == 0
        if model == "lora":  # the merged q_proj comes whole out of DTensor ops on the adapters, which the report
            # does not count; the merged experts are gathered as the plain model's
            assert experts == by_model["qwen3_moe"][ep]["switch"][2]
        else:
            assert received == pytest.approx(predicted, rel=1e-12)


def _transformers_balancing_loss(batch) -> float:
    """transformers' own balancing loss of tiny-qwen3-moe on these rows (padded, its attention mask)."""
    model = load_causal_lm(str(resolve_model_path("tiny-qwen3-moe")), dtype=torch.float32)
    with torch.no_grad():
        out = model(
            input_ids=batch.batch[INPUT_IDS],
            attention_mask=batch.batch[ATTENTION_MASK],
            position_ids=batch.batch[POSITION_IDS],
            output_router_logits=True,
        )
    return float(out.aux_loss)


def test_the_balancing_loss_is_transformers_and_moves_the_routers(results, rollout_batch):
    shares = rollout_batch[ROWS].chunk(WORLD)
    tokens = [float(share.batch[RESPONSE_MASK].sum()) for share in shares]
    for rank, by_model in enumerate(results):
        weighted, unweighted = by_model["aux 0.5"], by_model["aux 0.0"]
        first = weighted[1]["metrics"][0]
        # a rank's metric is its share of the batch's (by response tokens) times the ranks, which the driver averages
        expected = _transformers_balancing_loss(shares[rank]) * tokens[rank] / sum(tokens) * WORLD
        assert first["actor/router_aux_loss"] == pytest.approx(expected, rel=1e-5)
        assert "actor/router_aux_loss" not in unweighted[1]["metrics"][0]
        router = "model.layers.0.mlp.gate.weight"
        assert not torch.allclose(weighted[1]["params"][router], unweighted[1]["params"][router], rtol=0, atol=1e-7)
        for step in range(2):  # expert parallelism changes nothing with the loss on
            got, want = weighted[2]["metrics"][step], weighted[1]["metrics"][step]
            for key in ("actor/router_aux_loss", "actor/grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (rank, step, key)
        for name, value in weighted[1]["params"].items():
            _close(weighted[2]["params"][name], value, f"rank {rank} parameter {name}")


def test_the_busiest_expert_s_load_is_reported_for_each_layer(results):
    for layer in (0, 1):  # the driver's mean over the ranks: the batch's, between balanced (1) and E / k = 2
        key = f"actor/expert_load_max/layer_{layer}"
        load = sum(by_model["aux 0.5"][1]["metrics"][0][key] for by_model in results) / WORLD
        assert 1.0 <= load <= 2.0, (layer, load)


def test_the_gradients_reach_every_expert_and_the_router(results):
    grads = results[0]["qwen3_moe"][1]["grads"]
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        per_expert = grads[name].flatten(1).abs().sum(dim=1)
        assert bool((per_expert > 0).all()), name
    assert grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0


def test_a_zero_router_sends_every_token_to_two_experts_so_one_rank_gets_none():
    model = load_causal_lm(str(resolve_model_path("tiny-qwen3-moe")), dtype=torch.float32)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.zero_()
        _, _, chosen = block.gate(torch.randn(10, model.config.hidden_size))
    assert len(experts_modules(model)) == 2
    assert (
        chosen.unique() // 2
    ).unique().numel() == 1  # two experts of one ep = 2 rank: the other receives nothing here
