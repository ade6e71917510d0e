"""One decode step's attention in one layer: whole preallocated rows against the ragged kernel (run by hand).

    .venv/bin/python bench/decode_attention.py
    .venv/bin/python bench/decode_attention.py --sequences 64 --row 448 --lengths 64,160,270,448

smollm2's attention shape (3 kv heads of 3 query heads each, head dim 64), bf16, `--sequences` sequences
in a cache of `--row` positions per slot. `whole rows` is the engine's batched-matmul path (scores over
every position of the row, the unused ones masked: what it costs does not depend on the lengths);
`ragged` is rollout/native/ragged_attention.py at each length in `--lengths` (every sequence that long).
Median of `--repeats` timed calls of each, after a warm-up, all in this process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hybridflow.rollout.native import ragged_attention


def timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--row", type=int, default=448)
    parser.add_argument("--lengths", default="64,160,270,448")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not ragged_attention.available():
        raise SystemExit(f"the ragged kernel could not be built: {ragged_attention.unavailable_reason()}")
    b, hkv, g, d, t = args.sequences, 3, 3, 64, args.row
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(b + 2, hkv, t, d, generator=generator).bfloat16()
    values = torch.randn(b + 2, hkv, t, d, generator=generator).bfloat16()
    q = torch.randn(b, hkv, g, d, generator=generator).bfloat16()
    bias = torch.zeros(b * hkv, 1, t, dtype=torch.bfloat16)

    def whole_rows():
        k, v = keys[:b].view(b * hkv, t, d), values[:b].view(b * hkv, t, d)
        scores = torch.baddbmm(bias, q.view(b * hkv, g, d), k.transpose(1, 2), alpha=d**-0.5)
        return torch.bmm(scores.softmax(dim=-1), v)

    print(f"load average {os.getloadavg()[0]:.2f}; {b} sequences, rows of {t} positions, {args.threads} threads")
    base = timed(whole_rows, args.repeats)
    print("\n| attention of one layer | ms | vs whole rows |\n| --- | ---: | ---: |")
    print(f"| whole rows ({t} positions, any length) | {base:.3f} | 1.00x |")
    for length in (int(x) for x in args.lengths.split(",")):
        lengths = torch.full((b,), length, dtype=torch.int64)
        ms = timed(
            lambda lengths=lengths: ragged_attention.decode_attention(q, keys, values, lengths, d**-0.5), args.repeats
        )
        print(f"| ragged, every sequence {length} positions | {ms:.3f} | {base / ms:.2f}x faster |")


if __name__ == "__main__":
    main()
