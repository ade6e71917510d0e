"""Generation throughput: the native engine, vLLM and transformers' `generate`, on the same workloads
(run by hand, not a test).

    .venv/bin/python bench/rollout.py                     # every workload and backend, smollm2, 2 threads
    .venv/bin/python bench/rollout.py --workloads 64x64 --backends native,vllm
    .venv/bin/python bench/rollout.py --wait-idle 600     # on a shared machine: time only when others are idle
    .venv/bin/python bench/rollout.py --busy-cores 1      # with a CPU-bound process beside it on one core

The workloads: `64x64`, 64 distinct prompts; `16x4`, 16 prompts x 4 samples each (a GRPO
batch: the native engine prefills each prompt once, vLLM's prefix cache serves the copies);
`256`, 256 distinct prompts; every sequence gets exactly `--new-tokens` new tokens. All backends
get the same chat-templated arithmetic questions, the same sampling (temperature 1, no
top-k/top-p) and ignore EOS (`stop_token_ids=[]` for the engines, `min_new_tokens` for
`generate`), so they do equal work. `generate` is called as `HFRollout` calls it (with per-step
logits for the log-probs). vLLM runs in this process as the trainer runs it (`VllmRollout`,
the default `rollout.vllm` settings, eager; its prefix cache emptied before each timed call, as a weight
load empties it in training). Every backend runs in `--dtype` (default `auto`:
bf16 on a CPU with bf16 matmul units, fp32 elsewhere). The backends take turns within each repeat,
so load from other processes spreads over all of them; the best repeat of each is reported.
The native engine's achieved FLOP/s is set against the machine's matmul peak in that dtype,
measured in the same run, and the load average is printed: numbers from a loaded machine are low.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import random
import subprocess
import sys
import time

import torch
from transformers import GenerationConfig

from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype
from hybridflow.procfs import machine_busy_s, own_cpu_s
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.spec import ModelSpec
from hybridflow.trainer.setup.config import default_config


def arithmetic_prompts(tokenizer, count: int, group: int, seed: int = 0) -> DataProto:
    """`count` chat-templated "What is a + b?" prompts, each repeated `group` times (interleaved), left-padded."""
    rng = random.Random(seed)
    questions = [f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}?" for _ in range(count // group)]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
        for _ in range(group)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    positions = (enc["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "position_ids": positions}
    )


def matmul_peak(dtype: torch.dtype, size: int = 4096, repeats: int = 3) -> tuple[float, float]:
    """(best FLOP/s of a (size x size) @ (size x size) matmul in `dtype`, others' CPU share during it)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    seconds, others = _best(lambda: a @ b, repeats)
    return 2 * size**3 / seconds, others


def _busy_seconds() -> tuple[float, float]:
    """(CPU seconds all processes have been busy, CPU seconds of this process), from /proc."""
    return machine_busy_s() or 0.0, own_cpu_s()


def timed(fn) -> tuple[float, float]:
    """(wall seconds of fn(), share of the machine's CPUs that other processes used meanwhile)."""
    busy0, mine0 = _busy_seconds()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    busy1, mine1 = _busy_seconds()
    return elapsed, max(0.0, (busy1 - busy0) - (mine1 - mine0)) / (elapsed * os.cpu_count())


IDLE_WAIT = 0.0  # --wait-idle: seconds to wait at most, before each timed run, for the other processes to go quiet


def _wait_for_idle(window: float = 5.0, threshold: float = 0.05) -> None:
    """Wait (up to IDLE_WAIT s) until other processes use under `threshold` of the CPUs over `window` s."""
    deadline = time.time() + IDLE_WAIT
    while time.time() < deadline:
        busy0, mine0 = _busy_seconds()
        time.sleep(window)
        busy1, mine1 = _busy_seconds()
        if ((busy1 - busy0) - (mine1 - mine0)) / (window * os.cpu_count()) < threshold:
            return


def _best(fn, repeats: int) -> tuple[float, float]:
    """The fastest of `repeats` timed runs: (seconds, others' CPU share during it)."""
    runs = []
    for _ in range(repeats):
        _wait_for_idle()
        runs.append(timed(fn))
    return min(runs)


def engine_flops(spec: ModelSpec, stats, mean_prompt: float, new_tokens: int) -> float:
    """Model FLOPs the engine computed: prompt tokens (no lm_head), first tokens' lm_head, decode steps."""
    lm_head = 2 * spec.hidden_size * spec.vocab_size
    prefill = stats.prefill_tokens * (spec.flops_per_token(context=int(mean_prompt / 2)) - lm_head)
    first_tokens = stats.prefill_sequences * lm_head
    decode = stats.decode_tokens * spec.flops_per_token(context=int(mean_prompt + new_tokens / 2))
    return prefill + first_tokens + decode


WORKLOADS = {"64x64": (64, 1), "16x4": (64, 4), "256": (256, 1)}  # name: (sequences, samples per prompt)
BACKENDS = ("native", "vllm", "generate")


def build_backends(names: list[str], model, tokenizer, max_seqs: int) -> dict:
    """name -> generate(prompts, params): the native engine and vLLM over ``model``'s weights, and
    transformers' `generate` as HFRollout calls it."""
    config = default_config().actor_rollout_ref.rollout
    backends = {}
    if "native" in names:
        native = NativeRollout(model, tokenizer, engine_config=config.native, stop_token_ids=[])
        backends["native"] = native
    if "vllm" in names:
        from hybridflow.rollout.vllm.rollout import VllmRollout

        engine = dataclasses.replace(config.vllm, max_num_seqs=max(max_seqs, config.vllm.max_num_seqs))
        backends["vllm"] = VllmRollout(model, tokenizer, engine_config=engine, stop_token_ids=[])
    if "generate" in names:
        backends["generate"] = GenerateBaseline(model, tokenizer)
    return backends


class GenerateBaseline:
    """transformers' `generate` called as HFRollout calls it, forced to `max_new_tokens` (min_new_tokens)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto, params: SamplingParams):
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.max_new_tokens,
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        torch.manual_seed(params.seed)
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert out.sequences.shape[1] == ids.shape[1] + params.max_new_tokens
        return out


def forget_prompts(backend) -> None:
    """Empty vLLM's prefix cache, which would otherwise serve a repeat's prompts from the last repeat (in
    training every call follows a weight load, which empties it too); the other backends keep nothing."""
    llm = getattr(backend, "llm", None)
    if llm is not None:
        llm.reset_prefix_cache()


def busy_processes(cores: int) -> list[subprocess.Popen]:
    """``cores`` processes that each keep a core busy (a pure Python loop), to see each backend under
    contention. Plain processes, so that killing them leaves nothing behind."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {list(WORKLOADS)}")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {list(BACKENDS)}")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each backend (the best is reported)")
    parser.add_argument("--busy-cores", type=int, default=0, help="run a CPU-bound process on this many cores")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        help="before each timed run, wait up to this many "
        "seconds for other processes to leave the CPUs idle (on a shared machine)",
    )
    args = parser.parse_args()
    global IDLE_WAIT
    IDLE_WAIT = args.wait_idle
    workloads, names = args.workloads.split(","), args.backends.split(",")
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    print(f"load average before: {os.getloadavg()}; threads: {torch.get_num_threads()}; dtype: {dtype}")
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, dtype=dtype).eval()
    peak, peak_others = matmul_peak(dtype)
    backends = build_backends(names, model, tokenizer, max(WORKLOADS[w][0] for w in workloads))
    warm_up = SamplingParams(do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=1)
    busy = busy_processes(args.busy_cores)
    rows = []  # (workload, backend, seconds, others' CPU share, achieved FLOP/s or None)
    try:
        for workload in workloads:
            seqs, group = WORKLOADS[workload]
            prompts = arithmetic_prompts(tokenizer, seqs, group)
            params = SamplingParams(
                do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.new_tokens, seed=0
            )
            best: dict[str, tuple[float, float]] = {}
            for backend in backends.values():
                backend.generate_sequences(prompts[:8], warm_up)
            for _ in range(args.repeats):
                for name, backend in backends.items():
                    _wait_for_idle()
                    forget_prompts(backend)
                    run = functools.partial(backend.generate_sequences, prompts, params)
                    best[name] = min(best.get(name, (float("inf"), 0.0)), timed(run))
            mean_prompt = prompts.batch["attention_mask"].sum(1).float().mean().item()
            for name in backends:
                flops = None
                if name == "native":
                    native = backends["native"]
                    flops = engine_flops(native.engine.weights.spec, native.stats, mean_prompt, args.new_tokens)
                seconds, others = best[name]
                rows.append((workload, name, seconds, others, flops / seconds if flops else None))
            print(
                f"{workload}: {seqs // group} prompts x {group}, prompt {mean_prompt:.0f} tokens on average", flush=True
            )
    finally:
        for process in busy:
            process.kill()
            process.wait()
    print(
        f"\n{args.new_tokens} new tokens per sequence; {args.dtype} ({dtype}) matmul peak {peak / 1e9:.0f} GFLOP/s "
        f"(4096^3, other processes used {100 * peak_others:.0f}% of the CPUs meanwhile)"
        + (f"; a CPU-bound process kept {args.busy_cores} core(s) busy" if args.busy_cores else "")
        + "\n"
    )
    print(
        "| workload | backend | seconds | generated tokens/s | vs native | vs generate "
        "| achieved GFLOP/s (% of peak) | CPU used by other processes |"
    )
    print("| --- " * 8 + "|")
    seconds_of = {(w, b): secs for w, b, secs, _, _ in rows}
    for workload, name, secs, others, achieved in rows:
        generated = WORKLOADS[workload][0] * args.new_tokens
        ratios = [
            f"{seconds_of[(workload, base)] / secs:.2f}x" if (workload, base) in seconds_of else "-"
            for base in ("native", "generate")
        ]
        flop_cell = f"{achieved / 1e9:.0f} ({100 * achieved / peak:.0f}%)" if achieved else "-"
        print(
            f"| {workload} | {name} | {secs:.2f} | {generated / secs:.0f} | {ratios[0]} | {ratios[1]} "
            f"| {flop_cell} | {100 * others:.0f}% |"
        )
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
