"""The CUDA path on one GPU, checked against the CPU path and timed (run by hand on a GPU machine; CI has none).

    python bench/cuda_check.py --model smollm2-135m-instruct            # on a machine with the model installed
    python bench/cuda_check.py --random-init CONFIG_DIR --model DIR      # a random-initialised copy of CONFIG_DIR's
                                                                         # architecture (config + tokenizer) at DIR
    python bench/cuda_check.py --device cpu --model smollm2-135m-instruct --sizes 32:32   # the script itself, here

What it shows, each part printed as it finishes:

1. The actor as the trainer builds it (FSDP2 on a one-rank process group, NCCL on CUDA, bf16 compute, fp32 masters,
   fused AdamW) on ``--device``, beside the same actor on the CPU (gloo), on the GRPO-shaped batch of
   ``bench/train_passes.py``: each engine's log-probs against an fp32 CPU forward of the same weights (transformers,
   no hybridflow code), and one update's loss and gradient norm from each. The device's error must be of the CPU's
   size: both compute in bf16, with different kernels.
2. The update's time and MFU (the engine's own ``perf/mfu_update``, against the bf16 matmul peak measured in this
   process) at ``--sizes`` (samples:micro-batch rows): the GRPO step's batch first, then GPU-sized ones.
3. The native engine on the device: the rollout/trainer log-prob mismatch (its log-probs of the tokens it sampled
   against the device engine's recomputation, as the trainer's mismatch metrics see it), beside the same on the
   CPU; then generated tokens/s of the native engine and transformers' ``generate`` on the device.

A random-initialised model has nearly flat next-token distributions, so part 1's and 3's differences are smaller
than a trained model's; the timings do not depend on the weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_random_model(config_dir: Path, out: Path, seed: int = 0) -> None:
    """A model directory at ``out``: ``config_dir``'s architecture with random weights, and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (config_dir / name).exists():
            shutil.copy(config_dir / name, out / name)
    print(f"random-initialised {config.model_type} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M) at {out}")


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def actor_config(model: str, micro: int):
    from hybridflow.trainer.setup.config import load_config

    return load_config(
        [
            f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
            f"actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu={micro}",
            "actor_rollout_ref.actor.optim.lr=1e-5",
        ]
    ).actor_rollout_ref


def build_engine(model: str, micro: int, device):
    """(the trained model, its PolicyEngine) as the trainer builds the actor, on ``device``."""
    from hybridflow.engine.policy import PolicyEngine
    from hybridflow.models import load_causal_lm
    from hybridflow.workers.sharded_model import build_trainable

    arr = actor_config(model, micro)
    trained = build_trainable(
        load_causal_lm, arr.model.path, arr.model, arr.actor.fsdp, arr.actor.optim, device, 0, 100
    )
    return trained, PolicyEngine(trained, arr.actor)


def reference_log_probs(model: str, data) -> torch.Tensor:
    """log p(response token) from an fp32 CPU forward of the padded rows (transformers alone)."""
    from hybridflow.models import load_causal_lm

    reference = load_causal_lm(model, dtype=torch.float32).eval()
    ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
    width = data.batch["responses"].shape[1]
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask, position_ids=data.batch["position_ids"]).logits
    logits = logits[:, -width - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, data.batch["responses"][..., None])[..., 0]


def masked_abs(a, b, mask) -> tuple[float, float]:
    """(mean, max) of |a - b| where ``mask``."""
    diff = (a.float().cpu() - b.float().cpu()).abs()[mask.bool().cpu()]
    return diff.mean().item(), diff.max().item()


def check_actor(model: str, device) -> None:
    """Part 1: the device's actor against the CPU's and an fp32 reference."""
    from train_passes import grpo_batch

    from hybridflow.batch_keys import METRICS, OLD_LOG_PROBS

    data = grpo_batch(32, 4)
    reference = reference_log_probs(model, data)
    mask = data.batch["response_mask"]
    print(
        f"\n## 1. actor on {device} against the CPU (32 samples, bf16 compute; reference: fp32 CPU forward, "
        f"mean log-prob {reference[mask.bool()].mean():.3f})\n"
    )
    print("| engine | log-prob error vs fp32: mean | max | update's pg_loss | grad_norm |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for where in (torch.device("cpu"), device):
        trained, engine = build_engine(model, 32, where)
        batch = grpo_batch(32, 4).to(where)  # the same rows (seeded), a copy of its own
        log_probs = engine.compute_log_prob(batch, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
        batch.batch[OLD_LOG_PROBS] = log_probs
        metrics = engine.update_policy(batch, len(batch), 1.0, seed=0).meta_info[METRICS]
        mean, worst = masked_abs(log_probs, reference, mask)
        print(
            f"| {where.type} | {mean:.2e} | {worst:.2e} | {metrics['actor/pg_loss']:.6f} | "
            f"{metrics['actor/grad_norm']:.6f} |",
            flush=True,
        )
        del trained, engine


def time_updates(model: str, device, sizes: list[tuple[int, int]], repeats: int, profile: bool) -> None:
    """Part 2: the update's seconds and MFU at each (samples, micro-batch rows); ``profile``: then the last size's
    update under the profiler."""
    from train_passes import grpo_batch

    from hybridflow.batch_keys import METRICS, OLD_LOG_PROBS
    from hybridflow.engine.memory import peak_memory_gb, reset_peak_memory

    print(f"\n## 2. the update on {device}\n")
    print("| samples | micro-batch rows | tokens | seconds (median) | tokens/s | MFU | peak TFLOP/s | peak memory GB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for samples, micro in sizes:
        trained, engine = build_engine(model, micro, device)
        data = grpo_batch(samples, 4).to(device)
        data.batch[OLD_LOG_PROBS] = engine.compute_log_prob(data, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
        tokens = int(data.batch["attention_mask"].sum())
        reset_peak_memory(device)
        seconds, mfus = [], []
        for _ in range(repeats + 1):
            synchronize(device)
            start = time.perf_counter()
            out = engine.update_policy(data, len(data), 1.0, seed=0)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
            mfus.append(out.meta_info[METRICS]["perf/mfu_update"])
        median = statistics.median(seconds[1:])
        print(
            f"| {samples} | {micro} | {tokens} | {median:.4f} | {tokens / median:.0f} | "
            f"{statistics.median(mfus[1:]):.3f} | {engine.meter.peak / 1e12:.1f} | {peak_memory_gb(device):.2f} |",
            flush=True,
        )
        if profile and (samples, micro) == sizes[-1]:
            profile_update(engine, data, device)
        del trained, engine


def profile_update(engine, data, device, rows: int = 25) -> None:
    """One more update under torch.profiler: the ops with the most device time (self), and how much of the
    update's wall time the device was busy (a device idle between small kernels is waiting on the host)."""

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        synchronize(device)
        start = time.perf_counter()
        engine.update_policy(data, len(data), 1.0, seed=0)
        synchronize(device)
        wall = time.perf_counter() - start
    # the kernels themselves (an op's device time is its kernels': counting both would count it twice)
    ops = [op for op in prof.key_averages() if op.device_type == torch.autograd.DeviceType.CUDA]
    busy = [op.self_device_time_total / 1e6 for op in ops]
    total = sum(busy)
    print(f"\nprofiled update: {wall:.3f} s wall, {total:.3f} s of device time ({total / wall:.0%} busy)\n")
    print("| kernel | calls | device seconds | share of device time |")
    print("| --- | ---: | ---: | ---: |")
    for op, seconds in sorted(zip(ops, busy), key=lambda pair: -pair[1])[:rows]:
        print(f"| {op.key[:80]} | {op.count} | {seconds:.4f} | {seconds / max(total, 1e-9):.1%} |")


def check_rollout(model: str, device, sequences: int, new_tokens: int) -> None:
    """Part 3: the native engine's log-prob mismatch against the trainer's (device and CPU), then tokens/s."""
    from rollout import GenerateBaseline, arithmetic_prompts

    from hybridflow.batch_keys import OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
    from hybridflow.models import fast_dtype, load_causal_lm, load_tokenizer
    from hybridflow.rollout.native import NativeRollout
    from hybridflow.rollout.sampling import SamplingParams
    from hybridflow.trainer.setup.config import default_config

    tokenizer = load_tokenizer(model)
    native_config = default_config().actor_rollout_ref.rollout.native
    params = SamplingParams(do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new_tokens, seed=1)
    print(f"\n## 3. the native engine on {device}: rollout log-probs against the trainer's recomputation\n")
    print("| where | mean abs difference | max | mean ratio exp(rollout - trainer) |")
    print("| --- | ---: | ---: | ---: |")
    prompts = arithmetic_prompts(tokenizer, 32, 4)
    for where in (torch.device("cpu"), device):
        hf = load_causal_lm(model, dtype=fast_dtype(where)).to(where).eval()
        rollout = NativeRollout(hf, tokenizer, engine_config=native_config, stop_token_ids=[])
        out = rollout.generate_sequences(prompts.to(where), params)
        _, engine = build_engine(model, 32, where)
        trainer_lp = engine.compute_log_prob(out, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]
        mask = out.batch[RESPONSE_MASK]
        mean, worst = masked_abs(out.batch[ROLLOUT_LOG_PROBS], trainer_lp, mask)
        ratio = (out.batch[ROLLOUT_LOG_PROBS].float() - trainer_lp.float()).exp()[mask.bool()].mean().item()
        print(f"| {where.type} | {mean:.2e} | {worst:.2e} | {ratio:.4f} |", flush=True)
        del hf, rollout, engine

    hf = load_causal_lm(model, dtype=fast_dtype(device)).to(device).eval()
    backends = {
        "native": NativeRollout(hf, tokenizer, engine_config=native_config, stop_token_ids=[]),
        "generate": GenerateBaseline(hf, tokenizer),
    }
    prompts = arithmetic_prompts(tokenizer, sequences, 1).to(device)
    print(f"\n{sequences} prompts x {new_tokens} new tokens on {device}:\n")
    print("| backend | seconds (best of 3) | generated tokens/s |")
    print("| --- | ---: | ---: |")
    for name, backend in backends.items():
        backend.generate_sequences(prompts[:8], params)  # warm-up
        best = float("inf")
        for _ in range(3):
            synchronize(device)
            start = time.perf_counter()
            backend.generate_sequences(prompts, params)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        print(f"| {name} | {best:.3f} | {sequences * new_tokens / best:.0f} |", flush=True)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(part) for part in size.split(":")) for size in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a built-in name or a model directory")
    parser.add_argument("--random-init", type=Path, help="first write --model as this config's random-init copy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run (comma list of 1, 2, 3)")
    parser.add_argument("--sizes", default="32:32,256:256,2048:512", help="part 2's samples:micro-batch rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="part 2: profile one more update at the last size")
    parser.add_argument("--sequences", type=int, default=256, help="part 3's prompts for tokens/s")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no GPU is visible here (run it on a GPU machine, or --device cpu to try the script)")
    if args.random_init is not None:
        make_random_model(args.random_init, Path(args.model))
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    torch.manual_seed(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29671 + os.getpid() % 1000))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {name}; model {args.model}; load average {os.getloadavg()[0]:.2f}")
    parts = set(args.parts.split(","))
    if "1" in parts:
        check_actor(args.model, device)
    if "2" in parts:
        time_updates(args.model, device, parse_sizes(args.sizes), args.repeats, args.profile)
    if "3" in parts:
        check_rollout(args.model, device, args.sequences, args.new_tokens)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
