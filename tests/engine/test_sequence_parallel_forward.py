"""The packed forward under Ulysses sequence parallelism (engine/forward.py ``sp_group``), 4 gloo processes, fp32, two
model families (tiny-llama: 4 query and 2 key/value heads, so sp = 4 repeats them; tiny-qwen2: tied embeddings; and a
tiny-llama with SmolLM2-135M's 9 and 3 heads, which sp pads): every rank runs its slice of the packed tokens, and the
log-probs and entropy of every row equal one process's unsplit pass, so do a critic's values and a reward model's
scores, and the gradients summed over the sp group, over sp, equal its gradients (relative 1e-5; FSDP's mean over the
dp x sp ranks divides by sp in training). The batch packs rows of very different lengths: two sharing a prompt, a row
of 2 tokens (fewer than sp = 4: it lies in one rank's slice, or across two), and a total that no sp divides
(padding)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from hybridflow.engine.forward import response_log_probs, response_values
from hybridflow.engine.sequence_scores import sequence_scores
from hybridflow.models import load_causal_lm, load_critic, load_reward_model, resolve_model_path
from hybridflow.protocol import DataProto

WORLD = 4
# name: (built-in family, its size); "9-heads" has SmolLM2-135M's 9 query and 3 key/value heads, which no sp here
# divides (zero heads pad them)
FAMILIES = {
    "tiny-llama": ("tiny-llama", {}),
    "tiny-qwen2": ("tiny-qwen2", {}),
    "9-heads": ("tiny-llama", {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3}),
}


def model_dir(family: str) -> str:
    name, size = FAMILIES[family]
    return str(resolve_model_path(name, **size))


PROMPTS, RESPONSE_LENGTHS = (5, 5, 1, 3), (6, 3, 1, 4)  # rows 0 and 1 share their prompt; row 2 has 2 tokens (< sp 4)


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


def with_random_head(load):
    """A loader of the family's backbone with a value (or score) head drawn at random (a checkpoint without one gets
    zeros, which would make every value 0)."""

    def loaded(path: str):
        model = load(path, dtype=torch.float32)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.startswith("score."):
                    parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
        return model

    return loaded


def token_outputs(model, data: DataProto, group) -> list[torch.Tensor]:
    log_probs, entropy = response_log_probs(model, data, with_entropy=True, remove_padding=True, sp_group=group)
    return [log_probs, entropy]


def values(model, data: DataProto, group) -> list[torch.Tensor]:
    return [response_values(model, data, remove_padding=True, sp_group=group)]


def scores(model, data: DataProto, group) -> list[torch.Tensor]:
    return [sequence_scores(model, data, model.config.pad_token_id, remove_padding=True, sp_group=group)]


# each pass: how its model loads, and what it computes (every output weighed by fixed random weights into the loss)
PASSES = {
    "log-probs and entropy": (lambda path: load_causal_lm(path, dtype=torch.float32), token_outputs),
    "critic values": (with_random_head(load_critic), values),
    "reward-model scores": (with_random_head(load_reward_model), scores),
}


def step(kind: str, family: str, group) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], DataProto]:
    """The pass's outputs and the gradients of a loss weighing them by fixed random weights (and the batch)."""
    load, compute = PASSES[kind]
    model = load(model_dir(family))
    data = batch(model.config.vocab_size)
    outputs = compute(model, data, group)
    generator = torch.Generator().manual_seed(1)
    sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outputs).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return [out.detach() for out in outputs], grads, data


def _ranks(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results = {}
        for kind in PASSES:
            for family in FAMILIES:
                for sp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
                    outputs, grads, _ = step(kind, family, group)
                    for grad in grads.values():
                        dist.all_reduce(grad, group=group)
                    results[kind, family, sp] = (outputs, {name: grad / sp for name, grad in grads.items()})
        torch.save(results, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| over the whole tensor (a gradient's rounding is relative to its size, not each entry's)."""
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    for family in FAMILIES:
        model_dir(family)  # built once, here, before the processes read it
    directory = tmp_path_factory.mktemp("ulysses_forward")
    mp.spawn(_ranks, args=(str(directory / "init"), str(directory / "out")), nprocs=WORLD)
    return [torch.load(directory / f"out-{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", PASSES)
def test_outputs_and_gradients_equal_the_unsplit_pass(ranks, kind, family, sp):
    outputs, grads, data = step(kind, family, None)
    # per row (scores) or per response token (the rest): the padding is 0 on both sides
    mask = data.batch[RESPONSE_MASK].bool() if outputs[0].dim() == 2 else torch.ones(len(data), dtype=torch.bool)
    assert all(out[mask].abs().min() > 0 for out in outputs)  # real values to compare (a zero head gives none)
    for rank in range(WORLD):
        got_outputs, got_grads = ranks[rank][kind, family, sp]
        for got, want in zip(got_outputs, outputs, strict=True):
            torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
            assert not got[~mask].any()
        assert got_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert relative_error(got_grads[name], grad) < 1e-5, f"rank {rank}: {name}"


def test_a_padded_pass_refuses_sequence_parallelism(monkeypatch):
    """The refusal comes before any collective: a group that claims two ranks is enough to meet it."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    model = load_causal_lm(str(resolve_model_path("tiny-llama")), dtype=torch.float32)
    with pytest.raises(ValueError, match="sequence parallelism runs on packed rows"):
        response_log_probs(model, batch(model.config.vocab_size), remove_padding=False, sp_group=object())
    with pytest.raises(ValueError, match="sequence parallelism runs on packed rows"):
        sequence_scores(model, batch(model.config.vocab_size), 0, remove_padding=False, sp_group=object())
