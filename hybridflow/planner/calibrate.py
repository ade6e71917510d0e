"""``hybridflow plan --calibrate``: measure this machine and store the ``cpu`` preset's coefficients.

One device is one process with one torch thread (as ``trainer.cpus_per_worker=1`` runs ranks here).
Measured directly: the matmul peak in the fast dtype (engine/flops.py), the bytes per second a sum reads, and a gloo
all-reduce between 2 processes (bandwidth from an 8 MB one, latency from one of a decode step's size
less its bytes' time). Fitted to the cost model's own formulas (cost.py), so that the model reproduces
them: the passes' efficiency and fixed cost per layer call from a forward+backward of a random Llama at
a large and a small batch (two equations, two unknowns), and the generation engine's fixed cost per
layer call from it generating (decode efficiency 1: the measured read bandwidth is what a decode gets).
``save_calibration`` (cluster.py) writes the result to ``<cache>/planner/cpu.json``; ``cluster_preset("cpu")``
reads it from then on.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.planner.cluster import ClusterSpec
from hybridflow.planner.cost import generation_seconds, pass_seconds
from hybridflow.planner.workload import Workload, shape_from_hf

ONE_DEVICE = LayoutShape(dp=1, t=1, tg=1)
CALIBRATION_MODEL = {  # a random Llama big enough for compute to show, small enough to run in seconds
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1536,
    "vocab_size": 8192,
}


def _best_seconds(run, repeats: int) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(megabytes: int = 256) -> float:
    data = torch.ones(megabytes * 2**19, dtype=torch.bfloat16)
    return data.numel() * 2 / _best_seconds(lambda: data.sum(), 5)


SMALL_ALL_REDUCE = 24 * 576  # bf16 values: 24 sequences x SmolLM2's width


def _all_reduce_worker(rank: int, port: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = []
    for numel, repeats in ((SMALL_ALL_REDUCE, 200), (2**22, 10)):  # a decode step's activations; 8 MB
        tensor = torch.ones(numel, dtype=torch.bfloat16)
        for _ in range(5):
            dist.all_reduce(tensor)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        times.append((time.perf_counter() - start) / repeats)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def all_reduce_costs() -> tuple[float, float]:
    """(latency s, bandwidth B/s) of a gloo all-reduce between 2 processes (a ring moves 2(n-1)/n of it)."""
    from hybridflow.controller.worker import free_port

    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    processes = [context.Process(target=_all_reduce_worker, args=(rank, port, out)) for rank in range(2)]
    for process in processes:
        process.start()
    small, big = out.get(timeout=300)
    for process in processes:
        process.join()
    bandwidth = 2**22 * 2 / big  # bytes through each rank's link (2 (n - 1) / n = 1 for n = 2)
    return max(small - SMALL_ALL_REDUCE * 2 / bandwidth, 0.0), bandwidth


def _model_and_shape():
    from hybridflow.models import fast_dtype, load_causal_lm, resolve_model_path

    path = resolve_model_path("tiny-llama", **CALIBRATION_MODEL)
    model = load_causal_lm(path, dtype=fast_dtype(torch.device("cpu")))  # what `auto` trains in
    return path, model, shape_from_hf(model.config, "calibration")


def _pass_workload(shape, samples: int, length: int) -> Workload:
    return Workload(
        models={Role.ActorRollout: shape}, prompts=samples, n=1, prompt_length=length, response_length=0,
        micro_batch=samples,
    )  # fmt: skip


def fit_pass_costs(cluster: ClusterSpec, shape, measured: list[tuple[Workload, float]]) -> tuple[float, float]:
    """(train_efficiency, layer_overhead) that make ``pass_seconds(backward=True)`` equal two measured
    forward+backward times: each is compute / efficiency + calls x overhead, linear in (1 / efficiency,
    overhead)."""
    ideal = dataclasses.replace(cluster, train_efficiency=1.0, layer_overhead=0.0, collective_latency=0.0)
    rows, times = [], []
    for work, seconds in measured:
        compute = pass_seconds(shape, ONE_DEVICE, work, ideal, backward=True)
        calls = 3 * shape.layers  # one micro-batch: forward and backward
        rows.append((compute, calls))
        times.append(seconds)
    (a1, c1), (a2, c2) = rows
    determinant = a1 * c2 - a2 * c1
    inverse_efficiency = (times[0] * c2 - times[1] * c1) / determinant
    overhead = (a1 * times[1] - a2 * times[0]) / determinant
    return min(1.0, 1.0 / max(inverse_efficiency, 1.0)), max(overhead, 0.0)


def fit_decode_overhead(cluster: ClusterSpec, shape, work: Workload, seconds: float) -> float:
    """The generation engine's fixed cost per layer call that makes ``generation_seconds`` equal the
    measured ``seconds`` (it is linear in it: one prefill and one call per new token, each over the layers)."""
    free = generation_seconds(shape, ONE_DEVICE, work, dataclasses.replace(cluster, decode_layer_overhead=0.0))
    calls = (1 + work.response_length) * shape.layers
    return max((seconds - free) / calls, 0.0)


def calibrate(base: ClusterSpec, repeats: int = 3) -> ClusterSpec:
    """``base`` with every coefficient measured or fitted on this machine (one thread per device)."""
    from hybridflow.engine.flops import peak_flops
    from hybridflow.models import load_tokenizer
    from hybridflow.rollout.base import SamplingParams
    from hybridflow.rollout.native import NativeRollout
    from hybridflow.trainer.setup.config import default_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        latency, link = all_reduce_costs()
        cluster = dataclasses.replace(
            base,
            flops=peak_flops(torch.device("cpu")),
            memory_bandwidth=read_bandwidth(),
            collective_latency=latency,
            intra_node_bandwidth=link,
            inter_node_bandwidth=link,
        )
        path, model, shape = _model_and_shape()
        measured = []
        for samples, length in ((4, 256), (1, 8)):
            work = _pass_workload(shape, samples, length)
            ids = torch.randint(0, shape.vocab, (samples, length))

            def step(ids=ids):
                model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

            measured.append((work, _best_seconds(step, repeats)))
        efficiency, overhead = fit_pass_costs(cluster, shape, measured)
        cluster = dataclasses.replace(cluster, train_efficiency=efficiency, layer_overhead=overhead)
        model.zero_grad(set_to_none=True)
        engine = default_config().actor_rollout_ref.rollout.native
        rollout = NativeRollout(model, load_tokenizer(path), engine_config=engine, stop_token_ids=[])
        samples, prompt, response = 16, 32, 32
        prompts = _prompts(samples, prompt, shape.vocab)
        params = SamplingParams.greedy(max_new_tokens=response, seed=0)
        seconds = _best_seconds(lambda: rollout.generate_sequences(prompts, params), repeats)
        work = Workload(models={Role.ActorRollout: shape}, prompts=samples, n=1, prompt_length=prompt,
                        response_length=response)  # fmt: skip
        cluster = dataclasses.replace(cluster, decode_efficiency=1.0)
        return dataclasses.replace(cluster, decode_layer_overhead=fit_decode_overhead(cluster, shape, work, seconds))
    finally:
        torch.set_num_threads(threads)


def _prompts(samples: int, length: int, vocab: int):
    from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS
    from hybridflow.protocol import DataProto

    ids = torch.randint(3, vocab, (samples, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    return DataProto.from_dict({INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: mask.cumsum(1) - 1})
