"""Ulysses's exchange (engine/sequence_parallel.py) on 4 gloo processes, fp32: attention over sequence slices, with the
heads exchanged for the tokens and back, equals attention over the whole sequence in one process, output and the
gradients of q, k and v, for sp = 2 and sp = 4 and key/value heads more than, as many as and fewer than sp (GQA,
repeated), and query heads that sp does not divide (SmolLM2-135M's 9 and 3, padded with zero heads); the exchange and
its inverse give back the input."""

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
TOKENS, DIM = 12, 4
HEADS = ((8, 8), (8, 4), (8, 2), (8, 1), (9, 3), (6, 3))  # (query heads, key/value heads)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention, (1, H, N, d) queries over (1, Hkv, N, d) keys and values (query head h uses kv head
    h // (H / Hkv), as transformers groups them)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(1, heads, TOKENS, DIM, generator=generator)
    k, v = (torch.randn(1, kv_heads, TOKENS, DIM, generator=generator) for _ in range(2))
    weights = torch.randn(1, heads, TOKENS, DIM, generator=generator)  # the loss: sum(out * weights)
    return q, k, v, weights


def whole(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    q, k, v, weights = (t.clone().requires_grad_(i < 3) for i, t in enumerate(inputs(heads, kv_heads)))
    out = attention(q, k, v)
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def sliced(heads: int, kv_heads: int, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    """This rank's slice of the sequence through Ulysses's attention: its output and its inputs' gradients."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    span = slice(rank * TOKENS // sp, (rank + 1) * TOKENS // sp)
    q, k, v, weights = (t[:, :, span].clone().requires_grad_(i < 3) for i, t in enumerate(inputs(heads, kv_heads)))
    split = heads_for_sp(q, k, v, 1, sp)
    exchanged = [gather_sequence_scatter_heads(x, group, seq_dim=2, head_dim=1) for x in split]
    assert exchanged[0].shape == (1, split[0].shape[1] // sp, TOKENS, DIM)  # every token, this rank's heads
    out = gather_heads_scatter_sequence(attention(*exchanged), group, seq_dim=2, head_dim=1)[:, :heads]
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ranks(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results = {}
        for sp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
            for heads, kv_heads in HEADS:
                results[sp, heads, kv_heads] = sliced(heads, kv_heads, group)
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


@pytest.mark.parametrize("heads", HEADS, ids=lambda pair: f"{pair[0]}q-{pair[1]}kv")
@pytest.mark.parametrize("sp", [2, 4])
def test_attention_over_slices_equals_attention_over_the_whole_sequence(ranks, sp, heads):
    expected = whole(*heads)
    for rank in range(WORLD):
        slot = rank % sp
        span = slice(slot * TOKENS // sp, (slot + 1) * TOKENS // sp)
        for name, got, want in zip(("output", "q grad", "k grad", "v grad"), ranks[rank][sp, *heads], expected):
            torch.testing.assert_close(got, want[:, :, span], atol=1e-6, rtol=1e-5, msg=f"rank {rank} {name}")


def test_the_exchange_sends_head_slices_for_token_slices_and_its_inverse_gives_back_the_input(ranks):
    for rank in range(WORLD):
        there, came_back = ranks[rank]["round trip"]
        assert came_back and there.shape == (1, 1, 24, 2)  # one of 4 heads, 4 ranks' 6 tokens each
        for source in range(WORLD):  # rank `source`'s tokens, head `rank` of its input
            sent = torch.arange(48, dtype=torch.float32).view(1, 4, 6, 2)[:, rank] + 100 * source
            assert torch.equal(there[0, 0, 6 * source : 6 * (source + 1)], sent[0])


def test_heads_are_repeated_consecutively_or_padded():
    q8, kv2 = torch.zeros(1, 8, 4, 2), torch.arange(2.0).view(1, 2, 1, 1).expand(1, 2, 4, 2)
    q, k, _ = heads_for_sp(q8, kv2, kv2, 1, 4)  # GQA kept: each kv head twice, consecutively
    assert q.shape[1] == 8 and k[0, :, 0, 0].tolist() == [0, 0, 1, 1]
    q9, kv3 = torch.ones(1, 9, 4, 2), torch.arange(1.0, 4.0).view(1, 3, 1, 1).expand(1, 3, 4, 2)
    q, k, v = heads_for_sp(q9, kv3, kv3, 1, 2)  # a zero kv head with its group of 3 zero query heads
    assert (q.shape[1], k.shape[1], v.shape[1]) == (12, 4, 4)
    assert k[0, :, 0, 0].tolist() == [1, 2, 3, 0] and q[0, :9].all() and not q[0, 9:].any()
