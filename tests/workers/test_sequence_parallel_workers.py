"""The actor's, the critic's and a teacher's workers under Ulysses (layout sp = 2), on real Ray ranks, fp32: the two
ranks hold the same rows and split each micro-batch's tokens, FSDP2 shards over both, and dispatch sends the rows to
the one data-parallel index and collects one rank. Old log-probs, entropy, values, the update's loss, gradient norm
and weights equal the same rows split over 2 data-parallel ranks (sp = 1), with micro-batches of rows of unequal
lengths (and a LoRA actor, whose reference is the same model with its adapters off), and a distillation teacher's
log-probs; and so does the actor with tensor parallelism beside it on 4 ranks (t = 2: each sp pair exchanges its
shard's heads)."""

import pytest
import torch

from hybridflow.batch_keys import ENTROPYS, METRICS, OLD_LOG_PROBS, REF_LOG_PROB, RETURNS, TEACHER_LOG_PROB, VALUES
from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, register
from hybridflow.engine import forward
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import resolve_model_path
from hybridflow.trainer.setup.config import load_config
from hybridflow.workers import ActorRolloutWorker, CriticWorker, TeacherWorker

LR = 1e-2
LAYOUTS = {"dp=2": LayoutShape(dp=2, t=1, tg=1), "sp=2": LayoutShape(dp=1, t=1, tg=1, sp=2)}
WITH_TP = {"dp=2": LayoutShape(dp=2, t=2, tg=2), "sp=2": LayoutShape(dp=1, t=2, tg=2, sp=2)}


class TokenCounting:
    """A worker that counts the packed tokens its rank's forwards run (what sequence parallelism halves)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = 0
        run = forward.packed_forward

        def counted(model, packed, *args, **options):
            self.tokens += packed.input_ids.shape[1]
            return run(model, packed, *args, **options)

        forward.packed_forward = counted

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tokens_run(self) -> int:
        return self.tokens


class CountingActor(TokenCounting, ActorRolloutWorker):
    pass


class CountingCritic(TokenCounting, CriticWorker):
    pass


class CountingTeacher(TokenCounting, TeacherWorker):
    pass


def _assert_split(counts: dict[str, list[int]]) -> None:
    """Each sp rank ran about half the tokens that a rank of each data-parallel index ran (with t ranks each, all t
    run the same tokens; a slice is padded to a multiple of sp: at most one token more per micro-batch)."""
    per_index = sum(counts["dp=2"]) * 2 / len(counts["dp=2"])
    assert all(per_index / 2 <= tokens <= 0.55 * per_index for tokens in counts["sp=2"]), counts


def _actor_spec(config, layout: LayoutShape) -> RoleSpec:
    kwargs = dict(
        config=config,
        model_path=config.model.path,
        layout=layout,
        tool_config="",
        default_agent=config.rollout.multi_turn.default_agent,
        mini_batch_per_rank=config.actor.ppo_mini_batch_size * config.rollout.n // layout.dp,
        total_training_steps=10,
        seed=0,
    )
    return RoleSpec(CountingActor, kwargs=kwargs)


def _on(spec: RoleSpec, calls):
    pool = RayResourcePool([spec.kwargs["layout"].world])
    try:
        return calls(RayWorkerGroup(pool, spec))
    finally:
        pool.release()


def _actor_run(config, layout: LayoutShape, batch):
    def calls(group):
        scored = group.compute_log_prob(batch.select(deepcopy=True))
        data = batch.select(deepcopy=True)
        data.batch[OLD_LOG_PROBS] = scored.batch[OLD_LOG_PROBS]
        reference = None
        if config.model.lora.enabled:  # the reference is the actor's model with its adapters off
            reference = data.batch[REF_LOG_PROB] = group.compute_ref_log_prob(data).batch[REF_LOG_PROB]
        initial = group.full_state_dict()[0]
        metrics = group.update_actor(data).meta_info[METRICS]
        return scored, reference, metrics, group.full_state_dict()[0], initial, group.tokens_run()

    return _on(_actor_spec(config, layout), calls)


def _assert_same_steps(got: dict, want: dict, initial: dict) -> None:
    moved = 0
    for name, tensor in want.items():
        step_want, step_got = tensor - initial[name], got[name] - initial[name]
        moved += int(step_want.abs().max() > 0)
        torch.testing.assert_close(step_got, step_want, rtol=1e-4, atol=1e-7, msg=name)
    assert moved, "no parameter moved"


@pytest.mark.parametrize(
    "lora, layouts", [(False, LAYOUTS), (True, LAYOUTS), (False, WITH_TP)], ids=["plain", "lora", "with-tp-2"]
)
def test_the_actor_at_sp_2_equals_two_data_parallel_ranks(
    local_ray, tiny_path, rollout_batch, actor_config_factory, lora, layouts
):
    extra = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40"]
    if lora:
        extra += ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.actor.use_kl_loss=true"]
    config = actor_config_factory(tiny_path, LR, *extra)
    results = {name: _actor_run(config, layout, rollout_batch) for name, layout in layouts.items()}
    split, split_ref, split_metrics, split_weights, initial, _ = results["dp=2"]
    sp, sp_ref, sp_metrics, sp_weights, _, _ = results["sp=2"]
    _assert_split({name: result[-1] for name, result in results.items()})
    mask = rollout_batch.batch["response_mask"].bool()
    torch.testing.assert_close(sp.batch[OLD_LOG_PROBS][mask], split.batch[OLD_LOG_PROBS][mask], atol=1e-5, rtol=1e-5)
    if ENTROPYS in split.batch.keys():
        torch.testing.assert_close(sp.batch[ENTROPYS][mask], split.batch[ENTROPYS][mask], atol=1e-5, rtol=1e-5)
    if lora:
        torch.testing.assert_close(sp_ref[mask], split_ref[mask], atol=1e-5, rtol=1e-5)
    assert split_metrics["actor/grad_norm"] > 0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert sp_metrics[key] == pytest.approx(split_metrics[key], rel=1e-5, abs=1e-7), key
    _assert_same_steps(sp_weights, split_weights, initial)


def test_a_mixtures_balancing_loss_at_sp_2_is_the_whole_micro_batch_s(local_ray, rollout_batch, actor_config_factory):
    """Tiny Qwen3-MoE, its routers' balancing loss weighing 0.5 in the update: at sp = 2 each rank's routers see its
    slice of each micro-batch (the last slice padded to even them), and the slices' statistics summed over the pair
    make the loss, each layer's expert load, the gradient norm and the weights after the step equal one rank's running
    the whole micro-batches; and so do they with tensor parallelism beside (t = 2 x sp = 2)."""
    path = str(resolve_model_path("tiny-qwen3-moe"))
    config = actor_config_factory(path, LR, "actor_rollout_ref.actor.router_aux_loss_coef=0.5")
    layouts = {
        "sp=1": LayoutShape(dp=1, t=1, tg=1),
        "sp=2": LayoutShape(dp=1, t=1, tg=1, sp=2),
        "t=2 sp=2": LayoutShape(dp=1, t=2, tg=2, sp=2),  # each rank also holds half of the experts
    }
    results = {name: _actor_run(config, layout, rollout_batch) for name, layout in layouts.items()}
    _, _, whole, whole_weights, initial, _ = results["sp=1"]
    keys = [key for key in whole if "router_aux_loss" in key or "expert_load_max" in key]
    assert len(keys) == 3 and whole["actor/router_aux_loss"] > 2  # the loss and 2 layers' loads; k = 2 if balanced
    for name in ("sp=2", "t=2 sp=2"):
        _, _, split, split_weights, _, _ = results[name]
        for key in [*keys, "actor/pg_loss", "actor/grad_norm"]:
            assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), (name, key)
        _assert_same_steps(split_weights, whole_weights, initial)


def _critic_run(config, layout: LayoutShape, batch):
    spec = RoleSpec(
        CountingCritic,
        kwargs=dict(
            config=config,
            model_path=config.model.path,
            layout=layout,
            mini_batch_per_rank=len(batch) // layout.dp,
            total_training_steps=10,
            seed=0,
        ),
    )

    def calls(group):
        data = batch.select(deepcopy=True)
        data.batch[VALUES] = group.compute_values(data).batch[VALUES]
        data.batch[RETURNS] = data.batch["advantages"] + 0.5
        metrics = group.update_critic(data).meta_info[METRICS]
        return metrics, group.compute_values(batch.select(deepcopy=True)).batch[VALUES], group.tokens_run()

    return _on(spec, calls)


def test_the_critic_at_sp_2_equals_two_data_parallel_ranks(local_ray, tiny_path, rollout_batch):
    """The value head starts at 0 (a causal LM's checkpoint has none): the values after one update differ from 0 by
    what the whole model computes."""
    config = load_config(
        [
            f"critic.model.path={tiny_path}",
            "critic.fsdp.param_dtype=fp32",
            "critic.ppo_micro_batch_size_per_gpu=2",
            "critic.shuffle=false",
            f"critic.optim.lr={LR}",
            "critic.optim.eps=1.0",
            "critic.optim.weight_decay=0.0",
            "critic.grad_clip=1000.0",
        ]
    ).critic
    results = {name: _critic_run(config, layout, rollout_batch) for name, layout in LAYOUTS.items()}
    (split_metrics, split_values, _), (sp_metrics, sp_values, _) = results.values()
    _assert_split({name: result[-1] for name, result in results.items()})
    mask = rollout_batch.batch["response_mask"].bool()
    assert split_values[mask].abs().min() > 0
    torch.testing.assert_close(sp_values[mask], split_values[mask], atol=1e-5, rtol=1e-5)
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert sp_metrics[key] == pytest.approx(split_metrics[key], rel=1e-5, abs=1e-7), key


def test_the_teacher_at_sp_2_equals_two_data_parallel_ranks(local_ray, tiny_path, rollout_batch):
    config = load_config([f"teacher.model.path={tiny_path}", "teacher.fsdp.param_dtype=fp32"]).teacher

    def calls(group):
        return group.compute_teacher_log_prob(rollout_batch).batch[TEACHER_LOG_PROB], group.tokens_run()

    results = {}
    for name, layout in LAYOUTS.items():
        kwargs = dict(config=config, model_path=tiny_path, layout=layout, temperature=0.7, seed=0)
        results[name] = _on(RoleSpec(CountingTeacher, kwargs=kwargs), calls)
    mask = rollout_batch.batch["response_mask"].bool()
    assert results["dp=2"][0][mask].abs().min() > 0
    torch.testing.assert_close(results["sp=2"][0][mask], results["dp=2"][0][mask], atol=1e-5, rtol=1e-5)
    _assert_split({name: result[1] for name, result in results.items()})
