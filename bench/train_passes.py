"""The actor's training passes on smollm2, variant against variant (run by hand, not a test).

    .venv/bin/python bench/train_passes.py               # every variant, 5 repeats each
    .venv/bin/python bench/train_passes.py --repeats 8 --samples 64

Each variant runs in a process of its own (the allocator settings act at process start): a
1-rank FSDP2 actor built as the trainer builds it (`smollm2-135m-instruct`, bf16 compute, fp32
masters, fused AdamW, 2 threads), a GRPO-shaped batch (`--samples` rows: prompts of 38-47
tokens, each sampled 4 times, responses of 5-32 tokens; seeded), then `compute_log_prob` and
`update_policy` in turn. The first
repeat is warm-up; the table shows the median of the others and the ratio to the first variant,
all measured in this run.

Variants: the default (packed rows, each prompt once for its 4 samples, workers' allocator
settings), distinct prompts (the same token counts, nothing to share), glibc's default
allocator (freed blocks go back to the kernel), and padded rows (`use_remove_padding=false`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from hybridflow.controller.ray_runtime import ALLOCATOR_ENV

VARIANTS = {  # name: (environment, use_remove_padding, samples per prompt)
    "default (packed, 4 samples per prompt share it)": ({**ALLOCATOR_ENV}, True, 4),
    "distinct prompts (nothing to share)": ({**ALLOCATOR_ENV}, True, 1),
    "glibc's default allocator": ({}, True, 4),
    "padded rows (use_remove_padding=false)": ({**ALLOCATOR_ENV}, False, 4),
}


def measure(samples: int, repeats: int, remove_padding: bool, group: int) -> dict[str, list[float]]:
    """In this process: seconds of each pass, per repeat."""
    import torch
    import torch.distributed as dist

    from hybridflow.batch_keys import OLD_LOG_PROBS
    from hybridflow.engine.policy import PolicyEngine
    from hybridflow.models import load_causal_lm
    from hybridflow.trainer.setup.config import load_config
    from hybridflow.workers.sharded_model import build_trainable

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(2)
    arr = load_config(
        [
            "actor_rollout_ref.model.path=smollm2-135m-instruct",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={samples}",
            f"actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu={samples}",
            f"actor_rollout_ref.actor.use_remove_padding={str(remove_padding).lower()}",
            "actor_rollout_ref.actor.optim.lr=1e-5",
        ]
    ).actor_rollout_ref
    config = arr.actor
    trained = build_trainable(
        load_causal_lm, arr.model.path, arr.model, config.fsdp, config.optim, torch.device("cpu"), 0, 100
    )
    engine = PolicyEngine(trained, config)
    data = grpo_batch(samples, group)
    times: dict[str, list[float]] = {"log_prob": [], "update": []}
    for _ in range(repeats):
        start = time.perf_counter()
        data.batch[OLD_LOG_PROBS] = engine.compute_log_prob(data, 1.0, with_entropy=True).batch[OLD_LOG_PROBS]
        middle = time.perf_counter()
        engine.update_policy(data, len(data), 1.0, seed=0)
        times["log_prob"].append(middle - start)
        times["update"].append(time.perf_counter() - middle)
    dist.destroy_process_group()
    return times


def grpo_batch(samples: int, group: int, prompt_width: int = 48, response_width: int = 32):
    """`samples` rows: samples / group prompts, each repeated for `group` consecutive rows, random responses."""
    import torch

    from hybridflow.protocol import DataProto

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(38, prompt_width, (samples // group,), generator=generator).repeat_interleave(group)
    response = torch.randint(5, response_width + 1, (samples,), generator=generator)
    columns = torch.arange(prompt_width + response_width)
    mask = ((columns >= prompt_width - prompt[:, None]) & (columns < prompt_width + response[:, None])).long()
    ids = torch.randint(100, 40000, mask.shape, generator=generator)
    ids[:, :prompt_width] = ids[::group, :prompt_width].repeat_interleave(group, dim=0)
    ids = ids * mask
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, prompt_width:],
            "response_mask": mask[:, prompt_width:],
            "advantages": torch.randn(samples, response_width, generator=generator),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: measure one variant in this process
    args = parser.parse_args()
    if args.variant is not None:
        _, remove_padding, group = VARIANTS[args.variant]
        print(json.dumps(measure(args.samples, args.repeats, remove_padding, group)))
        return
    print(
        f"load average {os.getloadavg()[0]:.2f}; {args.samples} samples, {args.repeats} repeats (first dropped)",
        flush=True,
    )
    results = {}
    for name, (env, _, _) in VARIANTS.items():
        clean = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            name,
            "--samples",
            str(args.samples),
            "--repeats",
            str(args.repeats),
        ]
        out = subprocess.run(cmd, env={**clean, **env}, check=True, capture_output=True, text=True).stdout
        times = json.loads(out.strip().splitlines()[-1])
        results[name] = {stage: statistics.median(values[1:]) for stage, values in times.items()}
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in results[name].items()), flush=True)
    base = next(iter(results.values()))
    print("\n| variant | old log-probs (s) | update (s) | log-probs vs default | update vs default |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, times in results.items():
        print(
            f"| {name} | {times['log_prob']:.2f} | {times['update']:.2f} | "
            f"{times['log_prob'] / base['log_prob']:.2f}x | {times['update'] / base['update']:.2f}x |"
        )


if __name__ == "__main__":
    main()
