"""Pipeline parallelism's bubble and time: the actor's update of SmolLM2-135M in 2 stages against 2 data-parallel ranks
(run by hand).

    .venv/bin/python bench/pipeline.py                              # m = 2, 4, 8 micro-batches a step
    .venv/bin/python bench/pipeline.py --micro-batches 4 --repeats 2 --out /tmp/pipeline.png

Each case is a fresh group of 2 processes (gloo, one core each) running the actor's engine as a run builds it
(workers/sharded_model.py ``build_trainable``, engine/policy.py ``update_policy``, the default dtype: bf16 where the
host has bf16 units) on one optimizer step over m micro-batches of ``--rows`` rows (a 64-token prompt and a 64-token
response each), timed after a warm-up step (the median of ``--repeats``):

- pp 2: the model in 2 stages of 15 layers (torch's 1F1B schedule), one data-parallel rank running all m micro-batches;
  each rank's busy time is the time its stage spends in its forwards, its backwards and (the last stage) the loss,
  measured inside the schedule; its bubble is the rest of the schedule's time (waiting on the other stage, and the
  sends). The 1F1B schedule's bubble on equal stages is (p - 1) / (m + p - 1) of each stage's time.
- dp 2: FSDP2 over the same 2 processes, each running m / 2 of the micro-batches: the same work without stages, with
  FSDP2's gathers and reductions between the ranks (through shared memory, the default), which one data-parallel rank
  at pp 2 does not have.

The planner's prediction of each update (planner/cost.py ``pass_seconds`` on the ``cpu`` preset, calibrated when
``hybridflow plan --calibrate`` has measured this machine) is printed beside the measured time.

The ratio of the two step times is what p = 2 costs on these 2 cores (the stages run side by side as the data-parallel
ranks do; what they add is the bubble and the sends, what they save is FSDP2's traffic). The last stage also computes
the LM head (49,152 x 576) and the loss, so the stages are not equal: the table shows each stage's busy seconds and
bubble; the slower stage's bubble is the one 1F1B's formula describes, the faster one also waits for the slower. The
load average is printed with the results.
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
from torch.distributed.pipelining import stage as pipelining_stage
from torch.distributed.pipelining.schedules import _PipelineSchedule

from hybridflow.batch_keys import (
    ADVANTAGES,
    ATTENTION_MASK,
    INPUT_IDS,
    OLD_LOG_PROBS,
    POSITION_IDS,
    RESPONSE_MASK,
    RESPONSES,
)
from hybridflow.engine.pipeline import PipelinedModel, pipeline_mesh
from hybridflow.engine.policy import PolicyEngine
from hybridflow.engine.tensor_parallel import training_mesh
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.trainer.setup.config import load_config
from hybridflow.workers.sharded_model import build_trainable

MODEL = "smollm2-135m-instruct"
PROMPT, RESPONSE = 64, 64


def predicted_seconds(pp: int, micro_batches: int, row_count: int) -> float:
    """The planner's seconds for the update of ``micro_batches`` x ``row_count`` rows at pp (2 ranks in all)."""
    from hybridflow.controller import Role
    from hybridflow.hybrid_engine.layout_shape import LayoutShape
    from hybridflow.models import model_config
    from hybridflow.planner.cluster import cluster_preset
    from hybridflow.planner.cost import pass_seconds
    from hybridflow.planner.workload import Workload, shape_from_hf

    shape = shape_from_hf(model_config(resolve_model_path(MODEL)), MODEL)
    workload = Workload(
        models={Role.ActorRollout: shape},
        prompts=micro_batches * row_count,
        n=1,
        prompt_length=PROMPT,
        response_length=RESPONSE,
        micro_batch=row_count,
    )
    layout = LayoutShape(dp=2 // pp, t=1, tg=1, pp=pp)
    return pass_seconds(shape, layout, workload, cluster_preset("cpu"), backward=True)


def bubble_of_1f1b(p: int, m: int) -> float:
    """The idle fraction of each of p equal stages in 1F1B over m micro-batches."""
    return (p - 1) / (m + p - 1)


def rows(count: int, vocab: int) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (count, PROMPT + RESPONSE), generator=generator)
    mask = torch.ones_like(ids)
    response_mask = mask[:, PROMPT:]
    columns = {
        INPUT_IDS: ids,
        ATTENTION_MASK: mask,
        POSITION_IDS: torch.arange(PROMPT + RESPONSE).expand(count, -1).clone(),
        RESPONSES: ids[:, PROMPT:],
        RESPONSE_MASK: response_mask,
        ADVANTAGES: torch.randn(response_mask.shape, generator=generator),
        OLD_LOG_PROBS: torch.zeros(response_mask.shape),
    }
    return DataProto.from_dict(columns)


class BusyClock:
    """Seconds this process spends in its stages' forwards, backwards and loss, and in the whole schedule."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.schedule = 0.0

    def install(self) -> None:
        clock = self

        def timed(original, attribute: str):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    setattr(clock, attribute, getattr(clock, attribute) + time.perf_counter() - start)

            return wrapper

        base = pipelining_stage._PipelineStageBase
        base.forward_maybe_with_nosync = timed(base.forward_maybe_with_nosync, "busy")
        base.backward_maybe_with_nosync = timed(base.backward_maybe_with_nosync, "busy")
        _PipelineSchedule._compute_loss = timed(_PipelineSchedule._compute_loss, "busy")
        PipelinedModel.run = timed(PipelinedModel.run, "schedule")


def _case(rank: int, pp: int, micro_batches: int, row_count: int, repeats: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        clock = BusyClock()
        clock.install()
        path = str(resolve_model_path(MODEL))
        dp = 2 // pp
        overrides = [
            f"actor_rollout_ref.model.path={path}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={row_count}",
            "actor_rollout_ref.actor.use_remove_padding=true",
        ]
        config = load_config(overrides).actor_rollout_ref
        device = torch.device("cpu")
        mesh = pipeline_mesh(device, dp, pp, 1) if pp > 1 else training_mesh(device, dp, 1)
        trained = build_trainable(
            load_causal_lm, path, config.model, config.actor.fsdp, config.actor.optim, device, 0, 100, mesh
        )
        engine = PolicyEngine(trained, config.actor, dp_group=mesh["dp"].get_group())
        vocab = trained.model.config.vocab_size
        data = rows(micro_batches * row_count, vocab).chunk(dp)[mesh["dp"].get_local_rank()]
        seconds, busy, schedule = [], [], []
        for step in range(repeats + 1):
            clock.busy = clock.schedule = 0.0
            dist.barrier()
            start = time.perf_counter()
            engine.update_policy(data, mini_batch_size=len(data), temperature=1.0, seed=step)
            seconds.append(time.perf_counter() - start)
            busy.append(clock.busy)
            schedule.append(clock.schedule)
        measured = [statistics.median(values[1:]) for values in (seconds, busy, schedule)]
        gathered = [None, None]
        dist.all_gather_object(gathered, measured)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def measure(pp: int, micro_batches: int, row_count: int, repeats: int) -> list[list[float]]:
    """Per rank: [step seconds, busy seconds in the stages, seconds in the schedule], medians."""
    with tempfile.TemporaryDirectory() as directory:
        init, out = Path(directory) / "init", Path(directory) / "result.pt"
        mp.spawn(_case, args=(pp, micro_batches, row_count, repeats, str(init), str(out)), nprocs=2)
        return torch.load(out)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted(m for (pp, m) in results if pp == 2)
    measured = [[1 - results[2, m][rank][1] / results[2, m][rank][2] for m in ms] for rank in (0, 1)]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ms, [bubble_of_1f1b(2, m) for m in ms], "k--", label="(p - 1) / (m + p - 1)")
    for rank, values in enumerate(measured):
        ax.plot(ms, values, "o-", label=f"stage {rank} measured")
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("idle fraction of the schedule")
    ax.set_xticks(ms)
    ax.set_title("1F1B bubble, SmolLM2-135M in 2 stages")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="a plot of the measured bubble against 1F1B's")
    args = parser.parse_args()
    resolve_model_path(MODEL)  # converted once, here, before the processes read it
    from hybridflow.planner.cluster import calibration_file

    calibrated = "calibrated" if calibration_file().is_file() else "not calibrated: the preset's defaults"
    print(f"{MODEL}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; planner {calibrated}", flush=True)
    results = {}
    for m in args.micro_batches:
        for pp in (1, 2):
            results[pp, m] = measure(pp, m, args.rows, args.repeats)
            print(f"  m {m}, {'pp 2' if pp == 2 else 'dp 2'}: {max(r[0] for r in results[pp, m]):.2f} s", flush=True)
    header = f"{'m':>3} {'dp2 s':>7} {'pred.':>6} {'pp2 s':>7} {'pred.':>6} {'x dp2':>6}"
    print(f"\n{header} {'busy 0 s':>9} {'busy 1 s':>9} {'1F1B bubble':>12} {'bubble 0':>9} {'bubble 1':>9}")
    for m in args.micro_batches:
        data_parallel = max(r[0] for r in results[1, m])
        staged = max(r[0] for r in results[2, m])
        idle = [1 - busy / schedule for _, busy, schedule in results[2, m]]
        busy = [b for _, b, _ in results[2, m]]
        predicted = [predicted_seconds(pp, m, args.rows) for pp in (1, 2)]
        print(
            f"{m:>3} {data_parallel:7.2f} {predicted[0]:6.2f} {staged:7.2f} {predicted[1]:6.2f} "
            f"{staged / data_parallel:6.2f} {busy[0]:9.2f} {busy[1]:9.2f} {bubble_of_1f1b(2, m):12.3f} "
            f"{idle[0]:9.3f} {idle[1]:9.3f}"
        )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.out:
        plot(results, args.out)


if __name__ == "__main__":
    main()
