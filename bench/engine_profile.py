"""Where the native engine's generation time goes, prefill and decode apart (run by hand, not a test).

    .venv/bin/python bench/engine_profile.py                       # smollm2, 64 prompts x 64 new tokens, 2 threads
    .venv/bin/python bench/engine_profile.py --prompts 16 --samples 4 --new-tokens 4

The engine runs as the rollout runs it (``NativeRollout``, the default ``rollout.native`` settings, in ``--dtype``) on
bench/rollout.py's workload (chat-templated arithmetic prompts, every sequence generating exactly ``--new-tokens``).
One call is timed without the profiler (the best of ``--repeats``), one more under ``torch.profiler``, with the
engine's ``prefill`` and ``decode`` forwards marked (model.py's functions, wrapped here; the sampling and the
scheduling between them are the rest). Each op's self time is charged to a kind:

- matmul: ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``linear`` and oneDNN's packed bf16 linear (the projections, the
  MLP, the head, decode attention's two batched products);
- attention: SDPA and its kernels (prefill), and the ragged kernel (with the rotary embedding and the KV store
  where decode's layers run fused: rollout/native/fused_layers.py);
- elementwise: norms, rotary, activations, adds and multiplies, softmax, casts (and the fused residual add with
  RMSNorm, and SiLU x up);
- memory: indexing, gathers, copies, concatenation, new tensors (the KV cache's writes among them);
- sampling: top-k/top-p, the random draws, log-softmax of the logits;
- other: everything else.

Printed per phase: its wall seconds (scaled to the unprofiled call, the profiler's overhead spread in proportion), the
share of each kind, and the part of the wall time no op accounts for (Python, dispatch and the scheduler between
kernel calls). The achieved FLOP/s of the whole call (bench/rollout.py ``engine_flops``) is set against the matmul
peak measured in the same run, and the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from rollout import arithmetic_prompts, engine_flops, matmul_peak, timed  # noqa: E402  (bench/rollout.py)

from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype  # noqa: E402
from hybridflow.rollout.native import NativeRollout, ragged_attention  # noqa: E402
from hybridflow.rollout.native import model as native_model  # noqa: E402
from hybridflow.rollout.sampling import SamplingParams  # noqa: E402
from hybridflow.trainer.setup.config import default_config  # noqa: E402

KINDS = {
    "matmul": (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::linear",
        "aten::matmul",
        "_linear_pointwise",
    ),
    "attention": ("scaled_dot_product", "flash_attention", "_efficient_attention", "ragged", "rope_store_attend"),
    "sampling": ("topk", "multinomial", "exponential", "log_softmax", "argmax", "cumsum", "sort", "rand"),
    "memory": (
        "index",
        "gather",
        "scatter",
        "copy_",
        "cat",
        "clone",
        "empty",
        "zeros",
        "full",
        "stack",
        "narrow",
        "slice",
        "select",
        "view",
        "reshape",
        "expand",
        "permute",
        "transpose",
        "contiguous",
        "as_strided",
        "unsqueeze",
        "_to_copy",
    ),
    "elementwise": (
        "add",
        "mul",
        "sub",
        "div",
        "neg",
        "pow",
        "rsqrt",
        "mean",
        "silu",
        "softmax",
        "exp",
        "masked_fill",
        "where",
        "to",
        "sum",
        "max",
        "clamp",
        "eq",
        "isin",
        "gt",
        "lt",
        "ge",
        "le",
        "bitwise",
        "logical",
        "fill",
    ),
}
PHASES = ("prefill", "decode")
# the C++ module's calls (ragged_attention.module()), marked so that the profiler charges them to a kind
KERNELS = {
    "attend": "ragged::attend",
    "rope_store_attend": "fused::rope_store_attend",
    "add_rms_norm": "fused::add_rms_norm",
    "silu_mul": "fused::silu_mul",
}


def kind_of(name: str) -> str:
    """The kind an op's name belongs to (matched in KINDS's order; the first match wins)."""
    for kind, patterns in KINDS.items():
        if any(pattern in name for pattern in patterns):
            return kind
    return "other"


def marked(function, label: str):
    def wrapper(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)

    return wrapper


def phase_of(event, ranges: dict[str, list[tuple[int, int]]]) -> str:
    """The marked phase an op ran in (by its start time inside a phase's range), or "rest"."""
    start = event.time_range.start
    for phase, spans in ranges.items():
        if any(lo <= start < hi for lo, hi in spans):
            return phase
    return "rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt (a GRPO group)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    print(f"load average before: {os.getloadavg()}; threads {torch.get_num_threads()}; dtype {dtype}", flush=True)
    tokenizer = load_tokenizer(args.model)
    config = default_config().actor_rollout_ref.rollout.native
    rollout = NativeRollout(
        load_causal_lm(args.model, dtype=dtype).eval(), tokenizer, engine_config=config, stop_token_ids=[]
    )
    prompts = arithmetic_prompts(tokenizer, args.prompts * args.samples, args.samples)
    params = SamplingParams(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.new_tokens, seed=0
    )
    rollout.generate_sequences(prompts[:8], params)  # warm-up
    seconds = min(timed(lambda: rollout.generate_sequences(prompts, params))[0] for _ in range(args.repeats))
    mean_prompt = prompts.batch["attention_mask"].sum(1).float().mean().item()
    flops = engine_flops(rollout.engine.weights.spec, rollout.stats, mean_prompt, args.new_tokens)
    peak, _ = matmul_peak(dtype)

    originals = {phase: getattr(native_model, phase) for phase in PHASES}
    kernels = ragged_attention.module() if ragged_attention.available() else None
    kernel_originals = {name: getattr(kernels, name) for name in KERNELS} if kernels is not None else {}
    for phase in PHASES:
        setattr(native_model, phase, marked(originals[phase], phase))
    for name, function in kernel_originals.items():
        setattr(kernels, name, marked(function, KERNELS[name]))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("call"):
                rollout.generate_sequences(prompts, params)
    finally:
        for phase, function in originals.items():
            setattr(native_model, phase, function)
        for name, function in kernel_originals.items():
            setattr(kernels, name, function)
    events = prof.events()
    ranges: dict[str, list[tuple[int, int]]] = {phase: [] for phase in PHASES}
    call = None
    for event in events:
        if event.name in PHASES:
            ranges[event.name].append((event.time_range.start, event.time_range.end))
        elif event.name == "call":
            call = event
    profiled_total = call.time_range.elapsed_us() / 1e6
    scale = seconds / profiled_total
    wall = {phase: sum(hi - lo for lo, hi in spans) / 1e6 for phase, spans in ranges.items()}
    wall["rest"] = profiled_total - sum(wall.values())
    by_phase: dict[str, dict[str, float]] = {phase: defaultdict(float) for phase in (*PHASES, "rest")}
    for event in events:
        if event.name in (*PHASES, "call") or "::" not in event.name:
            continue
        by_phase[phase_of(event, ranges)][kind_of(event.name)] += event.self_cpu_time_total / 1e6
    kinds = [*KINDS, "other"]
    print(
        f"\n{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens: {seconds:.2f} s unprofiled "
        f"({args.prompts * args.samples * args.new_tokens / seconds:.0f} tokens/s; profiled {profiled_total:.2f} s); "
        f"{flops / seconds / 1e9:.0f} GFLOP/s = {100 * flops / seconds / peak:.0f} % of the {peak / 1e9:.0f} GFLOP/s "
        f"matmul peak\n"
    )
    print("| phase | seconds | " + " | ".join(kinds) + " | no op (Python, dispatch) |")
    print("| --- " * (len(kinds) + 3) + "|")
    for phase in (*PHASES, "rest"):
        total = wall[phase]
        shares = [by_phase[phase][kind] / total if total else 0.0 for kind in kinds]
        gap = 1 - sum(shares)
        cells = " | ".join(f"{100 * share:.0f} %" for share in shares)
        print(f"| {phase} | {total * scale:.2f} | {cells} | {100 * gap:.0f} % |")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
