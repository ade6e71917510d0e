"""The training-side kernels the engine chose, against the alternatives (run by hand, not a test).

    .venv/bin/python bench/train_kernels.py

Each group times the variants on the same inputs (best of `--repeats`, 2 threads) and prints
the ratio to the group's first variant, all measured in this run:

- log-probs and entropy of 1024 x 49152 bf16 logits (smollm2's vocabulary): all rows at once
  against the row chunks the engine uses (`algorithms/entropy.py`);
- causal attention of 32 packed rows x 77 tokens, 9 query / 3 kv heads of 64, bf16, forward and
  backward: SDPA (CPU flash kernel), SDPA's math backend, and the engine's matmul attention
  (`engine/packing.py`), also with its causal bias made again each call (as before it was kept per length);
- one AdamW step over smollm2-135m's parameters: the for-loop, foreach and fused implementations.

It runs with the allocator settings of hybridflow's workers (re-executing itself with them), as
the engine does; `--default-allocator` keeps glibc's defaults, under which every freshly
allocated large buffer is page-faulted in and the unchunked variants look several times slower.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridflow.algorithms.entropy import ENTROPY_CHUNK, LOG_PROB_CHUNK, entropy_from_logits, log_probs_from_logits
from hybridflow.controller.ray_runtime import ALLOCATOR_ENV
from hybridflow.engine.packing import causal_bias, grouped_causal_attention
from hybridflow.models import load_causal_lm


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def report(title: str, variants: dict[str, Callable[[], object]], repeats: int) -> None:
    times = {name: best_seconds(fn, repeats) for name, fn in variants.items()}
    base = next(iter(times.values()))
    print(f"\n{title}\n\n| variant | ms | vs first |\n| --- | ---: | ---: |")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f}x |")


def log_prob_math(repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1024, 49152, generator=generator).bfloat16()
    labels = torch.randint(0, 49152, (1024,), generator=generator)
    rows = len(logits)
    report(
        "Log-probs and entropy, 1024 x 49152 bf16 logits",
        {
            "log-probs, all rows at once": lambda: log_probs_from_logits(logits, labels, chunk_size=rows),
            f"log-probs, chunks of {LOG_PROB_CHUNK} rows (engine)": lambda: log_probs_from_logits(logits, labels),
            "entropy, all rows at once": lambda: entropy_from_logits(logits, chunk_size=rows),
            f"entropy, chunks of {ENTROPY_CHUNK} rows (engine)": lambda: entropy_from_logits(logits),
        },
        repeats,
    )


def attention(repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).bfloat16().requires_grad_()

    q, k, v = tensor(32, 9, 77, 64), tensor(32, 3, 77, 64), tensor(32, 3, 77, 64)
    grad = torch.randn(32, 9, 77, 64, generator=generator).bfloat16()

    def sdpa(backend: SDPBackend | None) -> Callable[[], None]:
        def run() -> None:
            if backend is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(grad)

        return run

    def remade_bias() -> None:  # as before the bias was kept per length (engine/packing.py causal_bias)
        causal_bias.cache_clear()
        grouped_causal_attention(q, k, v, 64**-0.5).backward(grad)

    report(
        "Causal attention, 32 rows x 77 tokens, 9/3 heads of 64, bf16, forward + backward (one layer)",
        {
            "SDPA (default: CPU flash kernel)": sdpa(None),
            "SDPA, math backend": sdpa(SDPBackend.MATH),
            "matmul attention (engine)": lambda: grouped_causal_attention(q, k, v, 64**-0.5).backward(grad),
            "matmul attention, its causal bias made again each call": remade_bias,
        },
        repeats,
    )


def adamw(repeats: int) -> None:
    params = [p.detach().clone().requires_grad_() for p in load_causal_lm("smollm2-135m-instruct").parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    count = sum(p.numel() for p in params)
    optimizers = {
        "for-loop": torch.optim.AdamW(params, lr=1e-5, foreach=False),
        "foreach": torch.optim.AdamW(params, lr=1e-5, foreach=True),
        "fused (engine)": torch.optim.AdamW(params, lr=1e-5, fused=True),
    }
    report(
        f"One AdamW step over {count / 1e6:.0f} M fp32 parameters", {k: o.step for k, o in optimizers.items()}, repeats
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--default-allocator", action="store_true", help="glibc's defaults, not the workers' settings")
    args = parser.parse_args()
    if not args.default_allocator and any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})
    torch.set_num_threads(2)
    allocator = "glibc defaults" if args.default_allocator else "the workers' allocator settings"
    print(f"load average {os.getloadavg()[0]:.2f}; best of {args.repeats}; torch {torch.__version__}; {allocator}")
    log_prob_math(args.repeats)
    attention(args.repeats)
    adamw(args.repeats)


if __name__ == "__main__":
    main()
