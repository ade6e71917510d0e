"""Where the actor update's time goes, op by op (run by hand, not a test).

    .venv/bin/python bench/update_profile.py                 # the GRPO-step update: 32 samples, 1 rank, 2 threads
    .venv/bin/python bench/update_profile.py --samples 64 --micro 16 --repeats 5
    .venv/bin/python bench/update_profile.py --samples 64 --micro 16 --ranks 2 --threads 1   # the demo's update

The actor is built as the trainer builds it (``smollm2-135m-instruct``, FSDP2 on ``--ranks`` gloo ranks,
bf16 compute, fp32 masters, fused AdamW) with the workers' allocator settings (the script
re-executes itself with them), on the GRPO-shaped batch of ``bench/train_passes.py`` (prompts of
38-47 tokens, 4 samples each, responses of 5-32 tokens; on several ranks split as the trainer splits a batch:
whole prompts per rank, the ranks' tokens balanced). It times ``--repeats`` updates without
the profiler (median after a warm-up; the update's MFU is the engine's own ``perf/mfu_update``
against the bf16 matmul peak measured in this process), then profiles one more with
``torch.profiler`` and charges each op's self time to one item:

- forward or backward (an op under an autograd ``evaluate_function`` is backward), and within it
- the LM head's matmul (a matmul with the vocabulary as a dimension), the log-prob and entropy
  math on its logits, attention (the packed attention's own ops), the layers' other matmuls,
  and everything else (norms, activations, rotary, copies, the allocator's page faults);
- the optimizer step, gradient-norm clipping, FSDP's collectives (all-gather, reduce-scatter,
  all-reduce over gloo; with ``fsdp.host_collectives``, the default, ranks on one host gather and
  reduce through shared memory: their barriers count as collectives, their sums apart) and its
  copies in and out of the flat buffers.

The table's seconds are scaled so that they add up to the unprofiled median (the profiler's own
overhead spread in proportion); the raw profiled total is printed beside it. The profiler's own records
take heap memory the update would otherwise reuse, so under it the update's large buffers land on fresh
pages: the script prints the page faults of the profiled and the unprofiled updates, and FSDP2's gradient
copy-in (the first op to fill such a buffer) timed without the profiler, against its profiled time.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybridflow.controller.ray_runtime import ALLOCATOR_ENV  # noqa: E402

MODEL = "smollm2-135m-instruct"


def reexec_with_allocator_settings() -> None:
    if all(os.environ.get(key) == value for key, value in ALLOCATOR_ENV.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})


def one_rank(threads: int, port_base: int) -> None:
    """This process as an actor's only rank, as a worker runs it: the workers' allocator settings (re-executing with
    them), a gloo group of one (its port from ``port_base`` and the pid) and ``threads`` torch threads."""
    reexec_with_allocator_settings()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port_base + os.getpid() % 1000))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(threads)


def label(fn, name: str):
    """``fn`` wrapped in a profiler range called ``name``."""
    import torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapped


def install_labels() -> None:
    """Profiler ranges around the packed attention and the log-prob / entropy math."""
    from transformers import AttentionInterface

    import hybridflow.engine.forward as forward
    import hybridflow.engine.packing as packing
    import hybridflow.engine.update as update

    AttentionInterface.register(packing.PACKED_ATTENTION, label(packing.packed_sdpa_attention, "hf::attention"))
    forward.log_probs_from_logits = label(forward.log_probs_from_logits, "hf::log_prob")
    forward.entropy_from_logits = label(forward.entropy_from_logits, "hf::entropy")
    update.grad_norm_and_clip = label(update.grad_norm_and_clip, "hf::grad_norm_and_clip")


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")
# backward nodes of the packed attention's ops (gather into rows, scores, mask, softmax, scatter back)
ATTENTION_BACKWARD = (
    "BmmBackward",
    "SoftmaxBackward",
    "MaskedFillBackward",
    "IndexSelectBackward",
    "UnflattenBackward",
)
NORM_OPS = (
    "aten::mul",
    "aten::pow",
    "aten::mean",
    "aten::rsqrt",
    "aten::copy_",
    "aten::_to_copy",
    "aten::add",
    "aten::silu",
    "aten::neg",
    "aten::cat",
)
NORM_BACKWARD = ("PowBackward", "MeanBackward", "RsqrtBackward", "ToCopyBackward", "MulBackward", "NegBackward")


def item_of(event, vocab: int) -> str:
    """The breakdown item an op's self time belongs to, from its name, shapes and enclosing ranges."""
    names = []
    node = event
    while node is not None:
        names.append(node.name)
        node = node.cpu_parent
    joined = " | ".join(names)
    if "Optimizer.step" in joined:
        return "optimizer step (fused AdamW)"
    if "hf::grad_norm_and_clip" in joined:
        return "gradient norm and clipping"
    # an FSDP range's own time (in no op under it): its Python, and on several ranks its wait for a collective
    comms = any(tag in joined for tag in ("c10d::", "record_param_comms", "gloo:"))
    if comms or event.name.startswith(("FSDP::", "host_collectives::")):
        return "FSDP: collectives (gloo, or shared memory's barriers; launch and wait) and its hooks' own time"
    if "host_collectives::reduce_scatter" in joined:
        return "FSDP: shared-memory reduce-scatter, summing the ranks' chunks"
    if "FSDP::" in joined and any(tag in joined for tag in ("all_gather", "post_backward", "copy_in", "copy_out")):
        return "FSDP: copies into and out of the gathered / reduced buffers, casts to bf16"
    node_name = next((name.split(": ", 1)[1] for name in names if name.startswith("autograd::engine::evaluate")), "")
    side = "backward" if node_name else "forward"
    if "hf::log_prob" in joined or "hf::entropy" in joined or "ChunkedLogProb" in node_name:
        return f"{side}: log-prob and entropy on the logits"
    if event.name in MATMULS and any(vocab in shape for shape in event.input_shapes or [] if shape):
        return f"{side}: LM head matmul"
    if "hf::attention" in joined or node_name.startswith(ATTENTION_BACKWARD):
        return f"{side}: attention (gather into rows, scores, softmax, scatter back)"
    if event.name in MATMULS:
        return f"{side}: the layers' other matmuls (q, k, v, o, MLP)"
    if node_name.startswith("EmbeddingBackward") or event.name == "aten::embedding":
        return f"{side}: embedding"
    if node_name.startswith(NORM_BACKWARD) or (not node_name and event.name in NORM_OPS):
        return f"{side}: RMSNorm, rotary, SiLU x up, casts (elementwise)"
    return f"{side}: other (residual adds, views, copies, allocation)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--micro", type=int, default=None, help="micro-batch rows (default: all samples)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per rank")
    parser.add_argument(
        "--ranks", type=int, default=1, help="FSDP2 ranks (gloo processes, each with its share of the samples)"
    )
    parser.add_argument(
        "--override", action="append", default=[], help="a config key=value, e.g. reshard_after_forward"
    )
    parser.add_argument("--detail", type=int, default=0, help="also list the N largest (item, op, parent) entries")
    parser.add_argument("--trace", help="also write a Chrome trace of the profiled update here")
    args = parser.parse_args()
    reexec_with_allocator_settings()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29571 + os.getpid() % 1000))
    if args.ranks == 1:
        profile_rank(0, args)
        return
    import torch.multiprocessing as mp

    mp.spawn(profile_rank, args=(args,), nprocs=args.ranks)


def time_gradient_copy_in() -> list[float]:
    """A list that collects the seconds of each FSDP2 gradient copy-in (the gradients cast into the reduce-scatter
    buffer), timed without the profiler; empty if this torch has no such function to wrap."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    seconds: list[float] = []
    copy_in = getattr(collectives, "foreach_reduce_scatter_copy_in", None)
    if copy_in is None:
        return seconds

    @functools.wraps(copy_in)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return copy_in(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    collectives.foreach_reduce_scatter_copy_in = timed
    return seconds


def policy_engine(micro: int, overrides: list[str]):
    """(the trainable model, its PolicyEngine) as the actor builds them: SmolLM2, micro-batches of ``micro``
    samples, lr 1e-5, any config ``overrides``, on this process's rank (the process group already started)."""
    import torch

    from hybridflow.engine.policy import PolicyEngine
    from hybridflow.models import load_causal_lm
    from hybridflow.trainer.setup.config import load_config
    from hybridflow.workers.sharded_model import build_trainable

    arr = load_config(
        [
            f"actor_rollout_ref.model.path={MODEL}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
            f"actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu={micro}",
            "actor_rollout_ref.actor.optim.lr=1e-5",
            *overrides,
        ]
    ).actor_rollout_ref
    trained = build_trainable(
        load_causal_lm, arr.model.path, arr.model, arr.actor.fsdp, arr.actor.optim, torch.device("cpu"), 0, 100
    )
    return trained, PolicyEngine(trained, arr.actor)


def profile_rank(rank: int, args: argparse.Namespace) -> None:
    """One rank's updates and profile; rank 0 prints (every rank runs the same passes and collectives)."""
    import torch
    import torch.distributed as dist
    from train_passes import grpo_batch

    from hybridflow.batch_keys import METRICS, OLD_LOG_PROBS
    from hybridflow.lengths import balanced_order, packed_lengths

    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    say = print if rank == 0 else (lambda *_, **__: None)
    torch.set_num_threads(args.threads)
    micro = args.micro or args.samples
    trained, engine = policy_engine(micro, args.override)
    vocab = trained.model.config.vocab_size
    batch = grpo_batch(args.samples, 4)
    # as the trainer splits a batch (PPOTrainer.rank_order): whole prompts per rank, about as many tokens on each
    batch = batch.reorder(
        balanced_order(packed_lengths(batch), args.ranks, groups=[row // 4 for row in range(len(batch))])
    )
    data = batch.chunk(args.ranks)[rank]
    data.batch[OLD_LOG_PROBS] = engine.compute_log_prob(data, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
    say(
        f"load average {os.getloadavg()[0]:.2f}; {args.samples} samples on {args.ranks} rank(s), micro-batches "
        f"of {micro}, {args.threads} threads per rank, {' '.join(args.override) or 'defaults'}, "
        f"peak {engine.meter.peak / 1e12:.3f} TFLOP/s (bf16 matmul, measured now)",
        flush=True,
    )

    copy_in = time_gradient_copy_in()
    seconds, mfus, faults, copy_in_seconds = [], [], [], []
    for _ in range(args.repeats + 1):
        copy_in.clear()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        out = engine.update_policy(data, len(data), 1.0, seed=0)
        seconds.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        copy_in_seconds.append(sum(copy_in))
        mfus.append(out.meta_info[METRICS]["perf/mfu_update"])
    median = statistics.median(seconds[1:])
    say(
        f"update: median {median:.3f} s over {args.repeats} (after a warm-up of {seconds[0]:.2f} s); "
        f"MFU {statistics.median(mfus[1:]):.3f} (each: {', '.join(f'{m:.3f}' for m in mfus[1:])}); "
        f"page faults {statistics.median(faults[1:]):.0f}; FSDP's gradient copy-in "
        f"{statistics.median(copy_in_seconds[1:]):.3f} s",
        flush=True,
    )

    install_labels()
    copy_in.clear()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        engine.update_policy(data, len(data), 1.0, seed=0)
        profiled = time.perf_counter() - start
    profiled_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if args.trace:
        prof.export_chrome_trace(args.trace)
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.self_cpu_time_total > 0:
            totals[item_of(event, vocab)] += event.self_cpu_time_total / 1e6
    counted = sum(totals.values())
    untraced = max(profiled - counted, 0.0)
    totals["outside any op (Python, scheduling)"] += untraced
    scale = median / (counted + untraced)
    say(f"profiled update {profiled:.3f} s (ops {counted:.3f} s); shares scaled to the unprofiled {median:.3f} s")
    say(
        f"page faults in the profiled update: {profiled_faults} (unprofiled: {statistics.median(faults[1:]):.0f}); "
        f"FSDP's gradient copy-in there {sum(copy_in):.3f} s: the profiler's own allocations take memory the update "
        "would reuse, so the ops that fill fresh buffers (FSDP's copies first) read slower in the table than they run\n"
    )
    say("| item | seconds | share |")
    say("| --- | ---: | ---: |")
    for name, value in sorted(totals.items(), key=lambda kv: -kv[1]):
        say(f"| {name} | {value * scale:.3f} | {value / (counted + untraced):.1%} |")
    if args.detail:
        by_op: dict[tuple[str, str, str], float] = defaultdict(float)
        for event in prof.events():
            if event.self_cpu_time_total > 0:
                parent = event.cpu_parent.name if event.cpu_parent is not None else "-"
                by_op[(item_of(event, vocab), event.name, parent)] += event.self_cpu_time_total / 1e6
        say("\n| item | op | its parent | seconds (profiled) |\n| --- | --- | --- | ---: |")
        for (item, op, parent), value in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.detail]:
            say(f"| {item} | {op} | {parent} | {value:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
