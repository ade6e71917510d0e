"""The training pass on long prompts shared by GRPO's samples: each prompt's queries once (the packed attention's
prompt/response split, engine/row_attention.py) against every row whole, alternated in one process (run by hand,
not a test).

    .venv/bin/python bench/long_prompts.py                    # 8 prompts x 4 samples, up to 1,024 + 256 tokens
    .venv/bin/python bench/long_prompts.py --prompts 4 --samples 8 --prompt-width 2048 --rounds 2

The actor as bench/update_profile.py builds it (SmolLM2, FSDP2 on one gloo rank, bf16, the workers' allocator
settings) on bench/train_passes.py's GRPO batch with long prompts (each prompt 38 up to ``--prompt-width`` tokens,
each response 5 up to ``--response-width``). Each round times the old-log-prob pass and one update with the whole
rows, then with the split (``PromptSplit.flash_scores`` patched to infinity turns the split off); it prints each
round, the medians and the ratios, then both sides' log-probs of the same weights and their largest difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_profile import one_rank, policy_engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="samples (rows) per prompt")
    parser.add_argument("--prompt-width", type=int, default=1024, help="the longest prompt, in tokens")
    parser.add_argument("--response-width", type=int, default=256, help="the longest response, in tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    one_rank(args.threads, port_base=29771)
    import torch
    import torch.distributed as dist
    from train_passes import grpo_batch

    from hybridflow.batch_keys import ATTENTION_MASK, OLD_LOG_PROBS, RESPONSE_MASK
    from hybridflow.engine.row_attention import PromptSplit

    rows = args.prompts * args.samples
    _, engine = policy_engine(rows, [])
    data = grpo_batch(rows, args.samples, prompt_width=args.prompt_width, response_width=args.response_width)
    real = int(data.batch[ATTENTION_MASK].sum())
    once = int(data.batch[ATTENTION_MASK][:: args.samples, : args.prompt_width].sum())
    print(f"load {os.getloadavg()[0]:.2f}; {rows} rows, {real} real tokens, {once} of them the prompts once")
    split_cost = PromptSplit.flash_scores
    sides = {"whole rows": lambda self, keys: float("inf"), "split": split_cost}

    def log_probs() -> torch.Tensor:
        return engine.compute_log_prob(data, 1.0, with_entropy=False).batch[OLD_LOG_PROBS]

    data.batch[OLD_LOG_PROBS] = log_probs()
    engine.update_policy(data, rows, 1.0, seed=0)  # warm-up
    seconds = {name: {"log-probs": [], "update": []} for name in sides}
    for round_ in range(args.rounds):
        for name, cost in sides.items():
            PromptSplit.flash_scores = cost
            start = time.perf_counter()
            log_probs()
            middle = time.perf_counter()
            engine.update_policy(data, rows, 1.0, seed=0)
            update = time.perf_counter() - middle
            seconds[name]["log-probs"].append(middle - start)
            seconds[name]["update"].append(update)
            print(f"round {round_ + 1} {name:<11} log-probs {middle - start:7.2f} s  update {update:7.2f} s")
    last = {}
    for name, cost in sides.items():
        PromptSplit.flash_scores = cost
        last[name] = log_probs()
    PromptSplit.flash_scores = split_cost
    for part in ("log-probs", "update"):
        whole, split = (statistics.median(seconds[name][part]) for name in sides)
        print(f"{part:<10} median: whole rows {whole:.2f} s, split {split:.2f} s: {whole / split:.2f}x")
    mask = data.batch[RESPONSE_MASK].bool()
    gap = float((last["whole rows"] - last["split"])[mask].abs().max())
    print(f"largest log-prob difference between the sides, the same weights: {gap:.3g}; load {os.getloadavg()[0]:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
