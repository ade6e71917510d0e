"""The actor update timed by part without the profiler (run by hand, not a test).

    .venv/bin/python bench/update_parts.py                 # bench/update_profile.py's batch: 32 samples, 1 rank
    .venv/bin/python bench/update_parts.py --repeats 8 --override actor_rollout_ref.actor.optim.lr=1e-6

The profiler's table (bench/update_profile.py) charges to the ops that fill fresh buffers the page faults its own
records cause; here nothing is profiled. The actor is built as bench/update_profile.py builds it (FSDP2 on one gloo
rank, bf16 compute, the workers' allocator settings), and each part's wall time is summed over an update by wrapping
the function that runs it: the forward (the policy engine's ``outputs``), the loss on its outputs, the backward
(``Tensor.backward``, FSDP2's reduce inside it, also shown alone), gradient clipping and the optimizer step. The
update's total and MFU are the engine's own; then the same forward on a plain bf16 copy of the model (no FSDP2).
Each repeat is printed (the first is a warm-up). One more update is run with each matmul (``mm``, ``addmm``, ``bmm``,
``baddbmm``) timed as it runs (a dispatch mode; the matmuls' own wall time, whatever the mode costs around them): their
seconds, their FLOP/s, and the MFU the update would reach if nothing but its matmuls ran, at their speed in place.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_profile import MODEL, one_rank, policy_engine  # noqa: E402


def wrap(owner, name: str, totals: dict[str, float], key: str | None = None) -> None:
    """``owner.name`` replaced by a version that adds its wall time to ``totals[key or name]``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key or name] += time.perf_counter() - start

    setattr(owner, name, timed)


def matmul_timer():
    """A dispatch mode that sums the wall time and FLOPs of every matmul run while it is active (CPU ops run as they
    are called). Made here: torch is imported after the allocator settings (``reexec_with_allocator_settings``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulTimer(TorchDispatchMode):
        OPS = {"mm", "addmm", "bmm", "baddbmm"}

        def __init__(self) -> None:
            super().__init__()
            self.seconds, self.flops, self.calls = 0.0, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in self.OPS:
                return func(*args, **(kwargs or {}))
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.seconds += time.perf_counter() - start
            self.calls += 1
            a, b = args[-2], args[-1]  # (..., M, K) @ (..., K, N); addmm and baddbmm take the bias first
            self.flops += 2 * a.numel() * b.shape[-1]
            return out

    return MatmulTimer()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--override", action="append", default=[], help="a config key=value")
    args = parser.parse_args()
    one_rank(args.threads, port_base=29671)

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group  # it calls foreach_reduce
    from train_passes import grpo_batch

    import hybridflow.engine.update as update
    from hybridflow.batch_keys import METRICS, OLD_LOG_PROBS
    from hybridflow.engine.forward import response_outputs
    from hybridflow.models import load_causal_lm

    trained, engine = policy_engine(args.samples, args.override)
    data = grpo_batch(args.samples, 4)
    data.batch[OLD_LOG_PROBS] = engine.compute_log_prob(data, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]

    parts: dict[str, float] = defaultdict(float)
    wrap(engine, "outputs", parts, "forward")
    wrap(engine, "_micro_loss", parts, "loss")
    wrap(torch.Tensor, "backward", parts, "backward")
    wrap(param_group, "foreach_reduce", parts, "FSDP reduce (in backward)")
    wrap(update, "grad_norm_and_clip", parts, "clipping")
    wrap(trained.optimizer, "step", parts, "optimizer step")
    print(
        f"load average {os.getloadavg()[0]:.2f}; {args.samples} samples, 1 rank, {args.threads} threads; peak "
        f"{engine.meter.peak / 1e12:.3f} TFLOP/s (bf16 matmul, measured now)",
        flush=True,
    )
    totals, mfus = [], []
    for repeat in range(args.repeats + 1):
        parts.clear()
        start = time.perf_counter()
        out = engine.update_policy(data, len(data), 1.0, seed=0)
        totals.append(time.perf_counter() - start)
        mfus.append(out.meta_info[METRICS]["perf/mfu_update"])
        shown = " ".join(f"{name} {seconds:.3f}" for name, seconds in parts.items())
        print(f"{'warm-up' if repeat == 0 else f'repeat {repeat}'}: update {totals[-1]:.3f} s ({shown})", flush=True)
    median, mfu = statistics.median(totals[1:]), statistics.median(mfus[1:])
    print(f"median update {median:.3f} s, MFU {mfu:.3f}")
    with matmul_timer() as matmuls:
        engine.update_policy(data, len(data), 1.0, seed=0)
    rate = matmuls.flops / matmuls.seconds
    print(
        f"its matmuls (one more update, each timed as it ran): {matmuls.calls} calls, {matmuls.seconds:.3f} s, "
        f"{rate / 1e12:.3f} TFLOP/s ({rate / engine.meter.peak:.0%} of the peak); the MFU if nothing but them ran: "
        f"{mfu * median / matmuls.seconds:.3f}"
    )

    plain = load_causal_lm(MODEL, dtype=torch.bfloat16)
    plain.train()
    seconds = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        response_outputs(plain, data, True)
        seconds.append(time.perf_counter() - start)
    print(f"the forward on a plain bf16 model (no FSDP2): median {statistics.median(seconds[1:]):.3f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
