"""Where one decode step of the native engine's routed MLP goes (run by hand, not a test).

    .venv/bin/python bench/moe_decode_parts.py
    .venv/bin/python bench/moe_decode_parts.py --rows 64 --experts 4 --top-k 2 --threads 2

SmolLM2-135M's widths (hidden 576, each expert an MLP of 1,536), seeded random bf16 weights packed for oneDNN as the
engine packs them (rollout/native/linear.py), ``--rows`` decode rows routed by a random router. Timed, in
microseconds (the mean of 300 calls after 20 warm-up ones): the routing (the engine's ``route_tokens``: router,
softmax, top-k, the sort by expert), the rows' gather, the experts' products (each expert's gate/up and down on its
rows), SiLU and the product, the weighted sum back, and the engine's whole ``routed_mlp``; against one dense MLP on
all the rows and one product pair over all the routed rows at once (what the experts' products would cost at the
same FLOPs in one call).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hybridflow.rollout.native.linear import Matrix
from hybridflow.rollout.native.model import route_tokens, routed_mlp
from hybridflow.rollout.native.weights import Experts

HIDDEN, WIDTH = 576, 1536  # SmolLM2-135M


def timed(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, generator = torch.bfloat16, torch.Generator().manual_seed(0)

    def weights(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(dtype)

    router = weights(args.experts, HIDDEN) * 50
    gate_up, down = weights(args.experts, 2 * WIDTH, HIDDEN), weights(args.experts, HIDDEN, WIDTH)
    layer = Experts(router=router, gate_up=gate_up, down=down, top_k=args.top_k)  # Mixtral's routing (renormalised)
    experts = layer.matrices
    experts.repack()
    dense_gate_up, dense_down = Matrix(weights(2 * WIDTH, HIDDEN)), Matrix(weights(HIDDEN, WIDTH))
    dense_gate_up.repack()
    dense_down.repack()
    x = torch.randn(args.rows, HIDDEN, generator=generator).to(dtype)

    def route():
        return route_tokens(layer, x)

    chosen_weights, order, counts = route()
    tokens = order // args.top_k
    rows = x[tokens]
    starts = [sum(counts[:e]) for e in range(args.experts)]
    chunks = [rows[s : s + c] for s, c in zip(starts, counts)]
    gate_ups = [experts.gate_up[e](chunk) for e, chunk in enumerate(chunks)]
    hiddens = [F.silu(g[:, :WIDTH]) * g[:, WIDTH:] for g in gate_ups]
    outputs = torch.cat([experts.down[e](h) for e, h in enumerate(hiddens)])

    def combine():
        combined = torch.zeros_like(x)
        return combined.index_add_(0, tokens, (outputs * chosen_weights.reshape(-1)[order, None]).to(dtype))

    def dense(inputs: torch.Tensor) -> torch.Tensor:
        gate, up = dense_gate_up(inputs).chunk(2, dim=-1)
        return dense_down(F.silu(gate) * up)

    parts = {
        "routing (the engine's route_tokens)": timed(route),
        "gather": timed(lambda: x[tokens]),
        "experts' gate/up products": timed(lambda: [experts.gate_up[e](c) for e, c in enumerate(chunks)]),
        "experts' down products": timed(lambda: [experts.down[e](h) for e, h in enumerate(hiddens)]),
        "SiLU and product": timed(lambda: [F.silu(g[:, :WIDTH]) * g[:, WIDTH:] for g in gate_ups]),
        "weighted sum back": timed(combine),
    }
    setting = f"{args.rows} rows, {args.experts} experts, {args.top_k} a token, {args.threads} threads"
    print(f"{setting}; rows per expert {counts}")
    print("| part | us |\n| --- | --- |")
    for name, micros in parts.items():
        print(f"| {name} | {micros:.0f} |")
    print(f"| the whole routed MLP (the engine's routed_mlp) | {timed(lambda: routed_mlp(layer, x)):.0f} |")
    print(f"| one dense MLP on the {args.rows} rows | {timed(lambda: dense(x)):.0f} |")
    print(f"| one product pair over all {len(rows)} routed rows | {timed(lambda: dense(rows)):.0f} |")


if __name__ == "__main__":
    main()
