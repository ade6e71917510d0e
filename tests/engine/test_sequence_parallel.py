"""Ulysses's exchange (engine/sequence_parallel.py) on 4 gloo processes, fp32: attention over sequence slices, with the
heads exchanged for the tokens and back, equals attention over the whole sequence in one process, output and the
gradients of q, k and v, for sp = 2 and sp = 4 and key/value heads more than, as many as and fewer than sp (GQA,
repeated); the exchange and its inverse give back the input; head counts that cannot split are refused."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from hybridflow.engine.sequence_parallel import (
    gather_heads_scatter_sequence,
    gather_sequence_scatter_heads,
    heads_for_sp,
)

WORLD = 4
HEADS, TOKENS, DIM = 8, 12, 4
KV_HEADS = (8, 4, 2, 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention, (1, H, N, d) queries over (1, Hkv, N, d) keys and values (query head h uses kv head
    h // (H / Hkv), as transformers groups them)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def inputs(kv_heads: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(1, HEADS, TOKENS, DIM, generator=generator)
    k, v = (torch.randn(1, kv_heads, TOKENS, DIM, generator=generator) for _ in range(2))
    weights = torch.randn(1, HEADS, TOKENS, DIM, generator=generator)  # the loss: sum(out * weights)
    return q, k, v, weights


def whole(kv_heads: int) -> tuple[torch.Tensor, ...]:
    q, k, v, weights = (t.clone().requires_grad_(i < 3) for i, t in enumerate(inputs(kv_heads)))
    out = attention(q, k, v)
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def sliced(kv_heads: int, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    """This rank's slice of the sequence through Ulysses's attention: its output and its inputs' gradients."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    span = slice(rank * TOKENS // sp, (rank + 1) * TOKENS // sp)
    q, k, v, weights = (t[:, :, span].clone().requires_grad_(i < 3) for i, t in enumerate(inputs(kv_heads)))
    exchanged = [
        gather_sequence_scatter_heads(heads_for_sp(x, 1, sp) if x is not q else x, group, seq_dim=2, head_dim=1)
        for x in (q, k, v)
    ]
    assert exchanged[0].shape == (1, HEADS // sp, TOKENS, DIM)  # every token, this rank's heads
    out = gather_heads_scatter_sequence(attention(*exchanged), group, seq_dim=2, head_dim=1)
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ranks(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results = {}
        for sp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
            for kv_heads in KV_HEADS:
                results[sp, kv_heads] = sliced(kv_heads, group)
        x = torch.arange(2 * 4 * 6, dtype=torch.float32).view(1, 4, 6, 2) + 100 * rank
        there = gather_sequence_scatter_heads(x, dist.group.WORLD, seq_dim=2, head_dim=1)
        back = gather_heads_scatter_sequence(there, dist.group.WORLD, seq_dim=2, head_dim=1)
        results["round trip"] = (there, torch.equal(back, x))
        torch.save(results, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ulysses")
    mp.spawn(_ranks, args=(str(directory / "init"), str(directory / "out")), nprocs=WORLD)
    return [torch.load(directory / f"out-{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("sp", [2, 4])
def test_attention_over_slices_equals_attention_over_the_whole_sequence(ranks, sp, kv_heads):
    expected = whole(kv_heads)
    for rank in range(WORLD):
        slot = rank % sp
        span = slice(slot * TOKENS // sp, (slot + 1) * TOKENS // sp)
        for name, got, want in zip(("output", "q grad", "k grad", "v grad"), ranks[rank][sp, kv_heads], expected):
            torch.testing.assert_close(got, want[:, :, span], atol=1e-6, rtol=1e-5, msg=f"rank {rank} {name}")


def test_the_exchange_sends_head_slices_for_token_slices_and_its_inverse_gives_back_the_input(ranks):
    for rank in range(WORLD):
        there, came_back = ranks[rank]["round trip"]
        assert came_back and there.shape == (1, 1, 24, 2)  # one of 4 heads, 4 ranks' 6 tokens each
        for source in range(WORLD):  # rank `source`'s tokens, head `rank` of its input
            sent = torch.arange(48, dtype=torch.float32).view(1, 4, 6, 2)[:, rank] + 100 * source
            assert torch.equal(there[0, 0, 6 * source : 6 * (source + 1)], sent[0])


def test_head_counts_that_cannot_split_over_sp_are_refused():
    three = torch.zeros(1, 3, 4, 2)
    with pytest.raises(ValueError, match="3 key/value heads cannot be shared by 2 sequence-parallel ranks"):
        heads_for_sp(three, 1, 2)
    assert heads_for_sp(torch.zeros(1, 2, 4, 2), 1, 4).shape[1] == 4  # each repeated twice, consecutively
    assert torch.equal(heads_for_sp(torch.arange(2.0).view(1, 2, 1, 1), 1, 4).flatten(), torch.tensor([0, 0, 1, 1.0]))
