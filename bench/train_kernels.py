"""The training-side kernels the engine chose, against the alternatives (run by hand, not a test).

    .venv/bin/python bench/train_kernels.py

Each group times the variants on the same inputs (best of `--repeats`, 2 threads) and prints
the ratio to the group's first variant, all measured in this run:

- log-probs and entropy of 1024 x 49152 bf16 logits (smollm2's vocabulary): all rows at once
  against the row chunks the engine uses (`algorithms/entropy.py`);
- causal attention of 32 packed rows x 77 tokens, 9 query / 3 kv heads of 64, bf16, forward and
  backward: SDPA (CPU flash kernel), SDPA's math backend, and the engine's matmul attention
  (`engine/packing.py`, its scale, mask and softmax one fused kernel each way), also with torch's ops for those
  and with its causal bias made again each call (as before it was kept per length);
- the same attention as the update runs it on bench/train_passes.py's packed batch (847 tokens), from the packed
  tokens into rows and back: torch's ops (index_select, copies, index_add_ backward) against the fused moves
  (kernels/packed_rows.py) and softmax;
- one AdamW step over smollm2-135m's parameters: the for-loop, foreach and fused implementations;
- RMSNorm (847 x 576) and SiLU(gate) * up (847 x 1536), bf16, forward and backward: transformers' ops against the
  fused kernels (kernels/elementwise.py);
- smollm2-135m's forward and backward on bench/train_passes.py's packed batch of 32 samples (847 tokens), bf16:
  torch's ops alone, against ``fuse_elementwise`` (engine/fused_modules.py) and the attention's fused kernels.

It runs with the allocator settings of hybridflow's workers (re-executing itself with them), as
the engine does; `--default-allocator` keeps glibc's defaults, under which every freshly
allocated large buffer is page-faulted in and the unchunked variants look several times slower.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridflow.algorithms.entropy import ENTROPY_CHUNK, LOG_PROB_CHUNK, entropy_from_logits, log_probs_from_logits
from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSES
from hybridflow.controller.ray_runtime import ALLOCATOR_ENV
from hybridflow.engine.forward import response_outputs
from hybridflow.engine.fused_modules import fuse_elementwise
from hybridflow.engine.packing import pack, packed_sdpa_attention
from hybridflow.engine.row_attention import causal_bias, grouped_causal_attention
from hybridflow.kernels import elementwise
from hybridflow.models import load_causal_lm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_passes import grpo_batch  # noqa: E402


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

    def fused_softmax() -> None:
        grouped_causal_attention(q, k, v, 64**-0.5).backward(grad)

    def torch_softmax() -> None:  # the scale, mask and softmax as torch's ops (before the fused kernel)
        with torch_ops_alone():
            grouped_causal_attention(q, k, v, 64**-0.5).backward(grad)

    report(
        "Causal attention, 32 rows x 77 tokens, 9/3 heads of 64, bf16, forward + backward (one layer)",
        {
            "SDPA (default: CPU flash kernel)": sdpa(None),
            "SDPA, math backend": sdpa(SDPBackend.MATH),
            "matmul attention (engine: the fused softmax)": fused_softmax,
            "matmul attention, torch's softmax": torch_softmax,
            "matmul attention, its causal bias made again each call": remade_bias,
        },
        repeats,
    )


def packed_attention(repeats: int) -> None:
    """One layer's packed attention as the update runs it: from the packed tokens into rows and back."""
    tensors = grpo_batch(32, 4).batch
    packed = pack(tensors[INPUT_IDS], tensors[ATTENTION_MASK], tensors[POSITION_IDS], tensors[RESPONSES].shape[1])
    tokens = packed.input_ids.shape[1]
    generator = torch.Generator().manual_seed(0)

    def by_token(heads: int) -> torch.Tensor:  # (1, heads, N, 64) laid out by token, as the projections leave it
        return torch.randn(1, tokens, heads, 64, generator=generator).bfloat16().transpose(1, 2).requires_grad_()

    q, k, v = by_token(9), by_token(3), by_token(3)
    grad = torch.randn(1, tokens, 9, 64, generator=generator).bfloat16()

    def run() -> None:
        packed_sdpa_attention(None, q, k, v, None, packed_segments=packed.segments)[0].backward(grad)

    def torch_ops() -> None:
        with torch_ops_alone():
            run()

    rows, longest = packed.segments.index.shape
    report(
        f"Packed attention, {tokens} tokens in {rows} rows of up to {longest}, 9/3 heads of 64, bf16, forward + "
        "backward (one layer)",
        {"torch's ops (index_select, copies, index_add_; softmax)": torch_ops, "engine (fused moves and softmax)": run},
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


@contextlib.contextmanager
def torch_ops_alone() -> Iterator[None]:
    """No fused kernel takes any tensor (kernels/elementwise.py ``fits``): torch's ops, as before them."""
    fits, elementwise.fits = elementwise.fits, lambda *tensors: False
    try:
        yield
    finally:
        elementwise.fits = fits


def backward_of(fn: Callable[..., torch.Tensor], grad: torch.Tensor, *inputs: torch.Tensor) -> Callable[[], None]:
    """fn(*inputs) and its backward, the inputs' gradients dropped after each call (none accumulates)."""

    def run() -> None:
        fn(*inputs).backward(grad)
        for tensor in inputs:
            tensor.grad = None

    return run


def fused_elementwise(repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).bfloat16().requires_grad_()

    norm = load_causal_lm("smollm2-135m-instruct", dtype=torch.bfloat16).model.norm
    x, grad = tensor(847, 576), torch.randn(847, 576, generator=generator).bfloat16()
    weight, eps = norm.weight.detach().clone().requires_grad_(), norm.variance_epsilon
    report(
        "RMSNorm, 847 x 576, bf16, forward + backward",
        {
            "transformers' ops": backward_of(lambda h, w: norm(h), grad, x, norm.weight),
            "fused (engine)": backward_of(lambda h, w: elementwise.rms_norm(h, w, eps), grad, x, weight),
        },
        repeats,
    )
    gate, up, grad = tensor(847, 1536), tensor(847, 1536), torch.randn(847, 1536, generator=generator).bfloat16()
    report(
        "SiLU(gate) * up, 847 x 1536, bf16, forward + backward",
        {
            "torch's ops": backward_of(lambda g, u: F.silu(g) * u, grad, gate, up),
            "fused (engine)": backward_of(elementwise.silu_mul, grad, gate, up),
        },
        repeats,
    )


def decoder_pass(repeats: int) -> None:
    data = grpo_batch(32, 4)
    plain = load_causal_lm("smollm2-135m-instruct", dtype=torch.bfloat16).train()
    fused = load_causal_lm("smollm2-135m-instruct", dtype=torch.bfloat16).train()
    count = fuse_elementwise(fused)

    def step(model: torch.nn.Module, fused_kernels: bool) -> Callable[[], None]:
        def run() -> None:
            with contextlib.nullcontext() if fused_kernels else torch_ops_alone():
                response_outputs(model, data, True).logits.float().mean().backward()
            model.zero_grad(set_to_none=True)

        return run

    report(
        "smollm2-135m forward + backward, 32 packed samples (847 tokens), bf16",
        {
            "torch's ops alone": step(plain, False),
            f"{count} modules fused and the attention's kernels (engine)": step(fused, True),
        },
        repeats,
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
    packed_attention(args.repeats)
    adamw(args.repeats)
    fused_elementwise(args.repeats)
    decoder_pass(args.repeats)


if __name__ == "__main__":
    main()
