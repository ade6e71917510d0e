"""A LoRA policy's sync to the native engine, and its generation, served against merged (run by hand, not a test).

    .venv/bin/python bench/lora_sync.py                      # SmolLM2-135M-Instruct, ranks 8 and 32
    .venv/bin/python bench/lora_sync.py --ranks 16 --prompts 32 --tokens 64 --repeats 5

In one process, on one engine per way of holding the policy, with adapters on every linear layer (peft, random
non-zero B so that they matter):
- ``full``: the merged policy loaded whole (``load_weights``: what every sync moved before adapter-sized syncs,
  and what a model trained whole moves),
- ``merged``: the adapters merged into the engine's weights from a kept copy of the base (``adapters: merged``),
- ``served``: the adapters served at each matmul (``adapters: served``, the native engine's default).
For each: the bytes a sync gives the engine, the seconds it takes (median of --repeats), the extra memory the
way holds, and greedy generation's tokens per second against the base model's, measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

from hybridflow.engine.lora import (
    LoraConfig,
    adapter_tensors,
    apply_lora,
    base_parameters,
    lora_scaling,
    policy_parameters,
)
from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeRollout
from hybridflow.trainer.setup.config import default_config


def prompts(tokenizer, count: int) -> DataProto:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {i} plus {2 * i + 7}? Answer with the number."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(count)
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    positions = (encoded["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "position_ids": positions}
    )


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def timed(repeats: int, fn, *args) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--dtype", default=default_config().actor_rollout_ref.rollout.dtype)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads (1: robust to load)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype, torch.device("cpu"))
    base_model = load_causal_lm(args.model, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(args.model)
    batch = prompts(tokenizer, args.prompts)
    greedy = SamplingParams.greedy(max_new_tokens=args.tokens, seed=0)
    settings = default_config().actor_rollout_ref.rollout.native
    print(
        f"{args.model}, engine dtype {dtype}, {torch.get_num_threads()} threads, {args.prompts} x {args.tokens} tokens"
    )

    def throughput(rollout: NativeRollout) -> float:
        rollout.generate_sequences(batch, greedy)  # warm up
        seconds = timed(args.repeats, rollout.generate_sequences, batch, greedy)
        return args.prompts * args.tokens / seconds

    plain = NativeRollout(base_model, tokenizer, engine_config=settings, dtype=dtype)
    base_tps = throughput(plain)
    print(f"base model: {base_tps:.1f} tokens/s")
    print("| rank | way | sync MB | sync s | extra memory MB | tokens/s | x base |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rank in args.ranks:
        lora = LoraConfig(rank=rank, alpha=args.alpha, dropout=0.0, target_modules=["all-linear"])
        model = apply_lora(copy.deepcopy(base_model), lora).eval()
        generator = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if ".lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
        scaling = lora_scaling(model)
        merged_policy = [(n, t.to(dtype)) for n, t in policy_parameters(model)]
        adapters = [(n, t.to(dtype)) for n, t in adapter_tensors(model)]
        base = [(n, t.to(dtype)) for n, t in base_parameters(model)]

        full = NativeRollout(base_model, tokenizer, engine_config=settings, dtype=dtype)
        seconds = timed(args.repeats, full.load_weights, merged_policy)
        reference = full.generate_sequences(batch, greedy).batch["responses"]
        tps = throughput(full)
        full_mb = nbytes(merged_policy) / 2**20
        print(f"| {rank} | full | {full_mb:.1f} | {seconds:.3f} | 0 | {tps:.1f} | {tps / base_tps:.2f} |")
        for way in ("merged", "served"):
            rollout = NativeRollout(
                base_model, tokenizer, engine_config=dataclasses.replace(settings, adapters=way), dtype=dtype
            )
            rollout.load_base_weights(base)
            seconds = timed(args.repeats, rollout.load_adapters, adapters, scaling)
            extra = nbytes(rollout._adapter_merge.base.items()) if way == "merged" else nbytes(adapters)
            same = torch.equal(rollout.generate_sequences(batch, greedy).batch["responses"], reference)
            tps = throughput(rollout)
            print(
                f"| {rank} | {way} | {nbytes(adapters) / 2**20:.2f} | {seconds:.3f} | {extra / 2**20:.1f} | "
                f"{tps:.1f} | {tps / base_tps:.2f} |" + ("" if same else " (responses differ from full's)")
            )


if __name__ == "__main__":
    main()
