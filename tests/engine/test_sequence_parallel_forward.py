"""The packed forward under Ulysses sequence parallelism (engine/forward.py ``sp_group``), 4 gloo processes, fp32, two
model families (tiny-llama: 4 query and 2 key/value heads, so sp = 4 repeats them; tiny-qwen2: tied embeddings):
every rank runs its slice of the packed tokens, and the log-probs and entropy of every row equal one process's
unsplit pass, so do a critic's values and a reward model's scores, and the gradients summed over the sp group, over
sp, equal its gradients (relative 1e-5; FSDP's mean over the dp x sp ranks divides by sp in training). The batch
packs rows of very different lengths: two sharing a prompt, a one-token response, and a total that no sp divides
(padding)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from hybridflow.engine.forward import response_log_probs, response_values, sequence_scores
from hybridflow.models import load_causal_lm, load_critic, load_reward_model, resolve_model_path
from hybridflow.protocol import DataProto

WORLD = 4
FAMILIES = ("tiny-llama", "tiny-qwen2")
PROMPTS, RESPONSE_LENGTHS = (5, 5, 3, 1), (6, 3, 1, 4)  # rows 0 and 1 share their prompt: 22 packed tokens


def batch(vocab: int) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    width_p, width_r = max(PROMPTS), max(RESPONSE_LENGTHS)
    ids = torch.zeros(len(PROMPTS), width_p + width_r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    shared = torch.randint(3, vocab, (PROMPTS[0],), generator=generator)
    for row, (prompt, answer) in enumerate(zip(PROMPTS, RESPONSE_LENGTHS)):
        ids[row, width_p - prompt : width_p] = (
            shared if row < 2 else torch.randint(3, vocab, (prompt,), generator=generator)
        )
        ids[row, width_p : width_p + answer] = torch.randint(3, vocab, (answer,), generator=generator)
        mask[row, width_p - prompt : width_p + answer] = 1
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    columns = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: position_ids, RESPONSES: ids[:, width_p:]}
    return DataProto.from_dict({**columns, RESPONSE_MASK: mask[:, width_p:]})


def step(model, data: DataProto, group) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs, entropy and the gradients of a loss weighing both by fixed random weights."""
    model.zero_grad(set_to_none=True)
    log_probs, entropy = response_log_probs(model, data, with_entropy=True, remove_padding=True, sp_group=group)
    weights = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(1))
    ((log_probs * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach(), entropy.detach(), grads


def critic(family: str, load=load_critic):
    """The family's backbone with a value (or score) head, drawn at random (a checkpoint without one gets zeros)."""
    model = load(str(resolve_model_path(family)), dtype=torch.float32)
    head = [p for name, p in model.named_parameters() if name.startswith("score.")]
    with torch.no_grad():
        for parameter in head:
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
    return model


def value_step(model, data: DataProto, group) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    values = response_values(model, data, remove_padding=True, sp_group=group)
    (values * torch.randn(values.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
    return values.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def score_step(model, data: DataProto, group) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    scores = sequence_scores(model, data, model.config.pad_token_id, remove_padding=True, sp_group=group)
    (scores * torch.randn(scores.shape, generator=torch.Generator().manual_seed(4))).sum().backward()
    return scores.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _ranks(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results = {}
        for family in FAMILIES:
            model = load_causal_lm(str(resolve_model_path(family)), dtype=torch.float32)
            data = batch(model.config.vocab_size)
            for sp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
                log_probs, entropy, grads = step(model, data, group)
                for grad in grads.values():
                    dist.all_reduce(grad, group=group)
                results[family, sp] = (log_probs, entropy, {name: grad / sp for name, grad in grads.items()})
            values_model = critic(family)
            for sp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
                values, grads = value_step(values_model, data, group)
                for grad in grads.values():
                    dist.all_reduce(grad, group=group)
                results[family, sp, "values"] = (values, {name: grad / sp for name, grad in grads.items()})
            scores_model = critic(family, load_reward_model)
            for sp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
                scores, grads = score_step(scores_model, data, group)
                for grad in grads.values():
                    dist.all_reduce(grad, group=group)
                results[family, sp, "scores"] = (scores, {name: grad / sp for name, grad in grads.items()})
        torch.save(results, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| over the whole tensor (a gradient's rounding is relative to its size, not each entry's)."""
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    for family in FAMILIES:
        resolve_model_path(family)  # built once, here, before the processes read it
    directory = tmp_path_factory.mktemp("ulysses_forward")
    mp.spawn(_ranks, args=(str(directory / "init"), str(directory / "out")), nprocs=WORLD)
    return [torch.load(directory / f"out-{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_log_probs_entropy_and_gradients_equal_the_unsplit_pass(ranks, family, sp):
    model = load_causal_lm(str(resolve_model_path(family)), dtype=torch.float32)
    data = batch(model.config.vocab_size)
    log_probs, entropy, grads = step(model, data, None)
    mask = data.batch[RESPONSE_MASK].bool()
    for rank in range(WORLD):
        got_log_probs, got_entropy, got_grads = ranks[rank][family, sp]
        torch.testing.assert_close(got_log_probs[mask], log_probs[mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_entropy[mask], entropy[mask], atol=1e-5, rtol=1e-5)
        assert not got_log_probs[~mask].any()  # 0 on response padding, as unsplit
        assert got_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert relative_error(got_grads[name], grad) < 1e-5, f"rank {rank}: {name}"


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_critic_values_and_their_gradients_equal_the_unsplit_pass(ranks, family, sp):
    model = critic(family)
    data = batch(model.config.vocab_size)
    values, grads = value_step(model, data, None)
    mask = data.batch[RESPONSE_MASK].bool()
    assert values[mask].abs().min() > 0  # a head that gives values
    for rank in range(WORLD):
        got_values, got_grads = ranks[rank][family, sp, "values"]
        torch.testing.assert_close(got_values[mask], values[mask], atol=1e-5, rtol=1e-5)
        assert got_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert relative_error(got_grads[name], grad) < 1e-5, f"rank {rank}: {name}"


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_reward_model_scores_and_their_gradients_equal_the_unsplit_pass(ranks, family, sp):
    model = critic(family, load_reward_model)
    scores, grads = score_step(model, batch(model.config.vocab_size), None)
    assert scores.abs().min() > 0 and len(set(scores.tolist())) == len(scores)
    for rank in range(WORLD):
        got_scores, got_grads = ranks[rank][family, sp, "scores"]
        torch.testing.assert_close(got_scores, scores, atol=1e-5, rtol=1e-5)
        assert got_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert relative_error(got_grads[name], grad) < 1e-5, f"rank {rank}: {name}"


def test_a_padded_pass_refuses_sequence_parallelism():
    model = load_causal_lm(str(resolve_model_path("tiny-llama")), dtype=torch.float32)

    class TwoRanks:  # stands for a group of two (the check comes before any collective)
        pass

    import hybridflow.engine.forward as forward

    original = forward.dist.get_world_size
    forward.dist.get_world_size = lambda group=None: 2
    try:
        with pytest.raises(ValueError, match="sequence parallelism runs on packed rows"):
            response_log_probs(model, batch(model.config.vocab_size), remove_padding=False, sp_group=TwoRanks())
    finally:
        forward.dist.get_world_size = original
