"""Ulysses sequence parallelism's memory and time per rank: one training micro-batch of SmolLM2-135M (run by hand).

    .venv/bin/python bench/sequence_parallel.py                          # 2k-16k tokens, sp 1, 2 and 4, bf16
    .venv/bin/python bench/sequence_parallel.py --checkpointing          # each layer recomputed in the backward
    .venv/bin/python bench/sequence_parallel.py --tokens 2048 4096 --sp 1 2 --out /tmp/sp.png

Each case is a fresh group of sp processes (gloo) that each load the model in bf16 (weights and gradients whole on
every rank, as FSDP2 gathers them layer by layer in training; they are not what sp divides) and run the actor's
packed forward on one row of the given length (a 64-token prompt, the rest the response), its log-probs and the
backward of their sum, each rank on its slice of the tokens (engine/forward.py ``sp_group``); with
``--checkpointing`` each decoder layer is recomputed in the backward (the actor's
``model.enable_gradient_checkpointing``). Per case:

- activation memory per rank: the peak resident set during the first forward and backward (Linux VmHWM, reset just
  before) minus the resident set before it and the gradients' bytes, the largest over the ranks (a later pass reuses
  memory the allocator kept, which the resident set does not show);
- seconds of the forward and backward (the slowest rank, the median of the ``--repeats`` after the first);
- the peak resident set per rank (the model, its gradients, the activations, the process's own);
- the ratio of each to sp = 1's at the same length.

The longest sequence that trains in ``--budget-gib`` per rank (the peak: weights, gradients and activations; the
optimizer state is FSDP2's and not counted) comes from a least-squares line through each sp's measured peaks (activation
memory grows linearly with the tokens: the attention runs through SDPA's memory-efficient kernel). The load average
is printed with the results; with more processes than cores (sp = 4 on 2 cores) the times say what sp costs on
this machine, not what it costs on a device per rank. A case whose peak, extrapolated from the shorter ones of the
same sp, would not fit in the machine's available memory is skipped, and said so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from hybridflow.engine.forward import response_log_probs
from hybridflow.engine.memory import peak_memory_gb, reset_peak_memory
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.models.loading import enable_activation_checkpointing
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto

MODEL = "smollm2-135m-instruct"
PROMPT = 64
GOAL_RATIO = 0.6  # the issue's target: activation memory at sp = 2 at most 0.6x sp = 1's


def one_row(tokens: int, vocab: int) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, tokens), generator=generator)
    mask = torch.ones_like(ids)
    columns = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: torch.arange(tokens).unsqueeze(0)}
    return DataProto.from_dict({**columns, RESPONSES: ids[:, PROMPT:], RESPONSE_MASK: mask[:, PROMPT:]})


def _case(rank: int, sp: int, tokens: int, repeats: int, checkpointing: bool, init: str, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sp))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=sp)
    try:
        model = load_causal_lm(str(resolve_model_path(MODEL)), dtype=torch.bfloat16)
        model.config.use_cache = False
        if checkpointing:
            enable_activation_checkpointing(model)
            model.train()  # transformers recomputes only in training mode
        data = one_row(tokens, model.config.vocab_size)
        group = dist.group.WORLD if sp > 1 else None
        grad_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        seconds, memory = [], None
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            before = resident_gb()
            reset_peak_memory(torch.device("cpu"))
            start = time.perf_counter()
            log_probs, _ = response_log_probs(model, data, remove_padding=True, sp_group=group)
            log_probs.sum().backward()
            seconds.append(time.perf_counter() - start)
            if memory is None:  # the first pass: later ones reuse what the allocator kept, which the peak misses
                peak = peak_memory_gb(torch.device("cpu"))
                memory = (peak - before - grad_gb, peak)
        timed = seconds[1:] or seconds  # the first pass also warms the kernels up
        result = torch.tensor([memory[0], statistics.median(timed), memory[1]], dtype=torch.float64)
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def measure(sp: int, tokens: int, repeats: int, checkpointing: bool) -> tuple[float, float, float]:
    """(activation GiB, seconds, peak resident GiB) of the rank with the most, over a fresh group."""
    with tempfile.TemporaryDirectory() as directory:
        init, out = Path(directory) / "init", Path(directory) / "result.pt"
        mp.spawn(_case, args=(sp, tokens, repeats, checkpointing, str(init), str(out)), nprocs=sp)
        activation, seconds, peak = torch.load(out).tolist()
    return activation, seconds, peak


def line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (tokens, GiB)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def longest_in_budget(points: list[tuple[int, float]], budget_gib: float) -> float:
    """Tokens where the line through the two longest measured (tokens, peak GiB per rank) reaches ``budget_gib``
    (the longest ones: shorter rows attend through matmuls whose scores grow with the square of the length,
    engine/packing.py ``MATMUL_ATTENTION_MAX_SCORES``)."""
    intercept, slope = line(sorted(points)[-2:])
    return (budget_gib - intercept) / slope


def available_gb() -> float:
    """MemAvailable of /proc/meminfo in GiB (infinite where there is none)."""
    for row in Path("/proc/meminfo").read_text().splitlines() if Path("/proc/meminfo").exists() else []:
        if row.startswith("MemAvailable:"):
            return int(row.split()[1]) / 2**20
    return float("inf")


def fits(points: list[tuple[int, float]], tokens: int, sp: int) -> bool:
    """Whether sp processes of the peak extrapolated (x 1.1) from ``points`` fit in the available memory."""
    available = available_gb()
    if not points:
        return True
    if len(points) == 1:  # proportional to the tokens: an overestimate (the model's share does not grow)
        predicted = points[0][1] * tokens / points[0][0]
    else:
        intercept, slope = line(sorted(points)[-2:])
        predicted = intercept + slope * tokens
    return sp * predicted * 1.1 < available


def plot(results: dict[tuple[int, int], tuple[float, float, float]], out: Path, recompute: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for sp in sorted({sp for sp, _ in results}):
        lengths = sorted(tokens for s, tokens in results if s == sp)
        axis.plot(lengths, [results[sp, tokens][0] for tokens in lengths], marker="o", label=f"sp = {sp}")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens in the micro-batch")
    axis.set_ylabel("activation memory per rank (GiB)")
    axis.set_title(f"Ulysses: {MODEL}, bf16, forward + backward{recompute}", fontsize=10)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    print(f"plot: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=12.0)
    parser.add_argument("--checkpointing", action="store_true", help="recompute each layer in the backward")
    parser.add_argument("--out", type=Path, default=None, help="a plot of activation memory per rank")
    args = parser.parse_args()
    resolve_model_path(MODEL)  # converted once, here, before the processes read it
    recompute = ", layers recomputed in the backward" if args.checkpointing else ""
    print(f"{MODEL}, bf16{recompute}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    results: dict[tuple[int, int], tuple[float, float, float]] = {}
    for tokens in args.tokens:
        for sp in args.sp:
            measured = [(length, results[s, length][2]) for s, length in results if s == sp]
            if not fits(measured, tokens, sp):
                print(f"  {tokens:>6} tokens, sp {sp}: skipped, it would not fit in this machine's memory", flush=True)
                continue
            results[sp, tokens] = measure(sp, tokens, args.repeats, args.checkpointing)
            activation, seconds, _ = results[sp, tokens]
            print(f"  {tokens:>6} tokens, sp {sp}: {activation:6.2f} GiB activations, {seconds:7.2f} s", flush=True)
    print(f"\n{'tokens':>7} {'sp':>3} {'act GiB':>8} {'x sp=1':>7} {'seconds':>8} {'x sp=1':>7} {'peak GiB':>9}")
    for (sp, tokens), (activation, seconds, peak) in sorted(results.items(), key=lambda item: item[0][::-1]):
        base = results.get((1, tokens))
        memory_ratio = f"{activation / base[0]:7.2f}" if base else f"{'':>7}"
        time_ratio = f"{seconds / base[1]:7.2f}" if base else f"{'':>7}"
        print(f"{tokens:>7} {sp:>3} {activation:8.2f} {memory_ratio} {seconds:8.2f} {time_ratio} {peak:9.2f}")
    for sp in args.sp:
        points = [(tokens, results[sp, tokens][2]) for tokens in args.tokens if (sp, tokens) in results]
        if len(points) >= 2:
            print(f"sp {sp}: ~{longest_in_budget(points, args.budget_gib):,.0f} tokens train in {args.budget_gib} GiB")
    both = [tokens for tokens in args.tokens if (1, tokens) in results and (2, tokens) in results]
    if both:
        worst = max(results[2, tokens][0] / results[1, tokens][0] for tokens in both)
        verdict = "met" if worst <= GOAL_RATIO else "NOT met"
        print(f"activation memory at sp 2: at most {worst:.2f}x sp 1's (goal <= {GOAL_RATIO}: {verdict})")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.out:
        plot(results, args.out, recompute)


if __name__ == "__main__":
    main()
