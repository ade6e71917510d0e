"""Generation throughput: the native engine against transformers' `generate` (run by hand, not a test).

    .venv/bin/python bench/rollout.py                  # 64 sequences x 64 new tokens, smollm2, 2 threads
    .venv/bin/python bench/rollout.py --group 4        # 16 prompts x 4 samples each (a GRPO batch)
    .venv/bin/python bench/rollout.py --engine-only    # skip the (slow) transformers runs
    .venv/bin/python bench/rollout.py --wait-idle 600  # on a shared machine: time only when others are idle

Both backends get the same chat-templated arithmetic questions, the same sampling
(temperature 1, no top-k/top-p) and generate exactly `--new-tokens` tokens per sequence (EOS
is ignored: `stop_token_ids=[]` for the engine, `min_new_tokens` for `generate`), so they do
equal work. `generate` is called as `HFRollout` calls it (with per-step logits for the
log-probs). The engine's achieved FLOP/s is set against the machine's bf16 matmul peak,
measured in the same run. The load average is printed: numbers from a loaded machine are low.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from transformers import GenerationConfig

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.spec import ModelSpec
from hybridflow.trainer.config import default_config


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


def matmul_peak(size: int = 4096, repeats: int = 3) -> tuple[float, float]:
    """(best FLOP/s of a (size x size) @ (size x size) bf16 matmul, others' CPU share during it)."""
    a, b = torch.randn(size, size, dtype=torch.bfloat16), torch.randn(size, size, dtype=torch.bfloat16)
    a @ b
    seconds, others = _best(lambda: a @ b, repeats)
    return 2 * size**3 / seconds, others


def _busy_seconds() -> tuple[float, float]:
    """(CPU seconds all processes have been busy, CPU seconds of this process), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    mine = os.times()
    return busy / ticks, mine.user + mine.system


def _timed(fn) -> tuple[float, float]:
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
        runs.append(_timed(fn))
    return min(runs)


def engine_flops(spec: ModelSpec, stats, mean_prompt: float, new_tokens: int) -> float:
    """Model FLOPs the engine computed: prompt tokens (no lm_head), first tokens' lm_head, decode steps."""
    lm_head = 2 * spec.hidden_size * spec.vocab_size
    prefill = stats.prefill_tokens * (spec.flops_per_token(context=int(mean_prompt / 2)) - lm_head)
    first_tokens = stats.prefill_sequences * lm_head
    decode = stats.decode_tokens * spec.flops_per_token(context=int(mean_prompt + new_tokens / 2))
    return prefill + first_tokens + decode


def run_engine(model, tokenizer, prompts: DataProto, params: SamplingParams, repeats: int):
    """((seconds, others' CPU share) of the best run, the rollout)."""
    rollout = NativeRollout(
        model, tokenizer, engine_config=default_config().actor_rollout_ref.rollout.native, stop_token_ids=[]
    )
    rollout.generate_sequences(
        prompts, SamplingParams(do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=1)
    )  # warm-up
    return _best(lambda: rollout.generate_sequences(prompts, params), repeats), rollout


def run_generate(model, tokenizer, prompts: DataProto, params: SamplingParams, repeats: int) -> tuple[float, float]:
    """(seconds, others' CPU share) of the best of `repeats` calls of `generate` as HFRollout makes it."""
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.max_new_tokens,
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    torch.manual_seed(params.seed)
    warm_up = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 2, "min_new_tokens": 2})
    with torch.no_grad():
        model.generate(input_ids=ids[:2], attention_mask=mask[:2], generation_config=warm_up)
        outputs = []
        best = _best(
            lambda: outputs.append(model.generate(input_ids=ids, attention_mask=mask, generation_config=config)),
            repeats,
        )
    assert outputs[-1].sequences.shape[1] == ids.shape[1] + params.max_new_tokens
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seqs", type=int, default=64, help="concurrent sequences")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--group", type=int, default=1, help="samples per prompt (1: all prompts distinct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each backend (the best is reported)")
    parser.add_argument("--engine-only", action="store_true")
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
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}; threads: {torch.get_num_threads()}")
    tokenizer = load_tokenizer(args.model)
    prompts = arithmetic_prompts(tokenizer, args.seqs, args.group)
    mean_prompt = prompts.batch["attention_mask"].sum(1).float().mean().item()
    params = SamplingParams(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.new_tokens, seed=0
    )
    generated = args.seqs * args.new_tokens
    peak, peak_others = matmul_peak()
    rows = []
    model = load_causal_lm(args.model, dtype=torch.bfloat16).eval()
    (seconds, others), rollout = run_engine(model, tokenizer, prompts, params, args.repeats)
    flops = engine_flops(rollout.engine.weights.spec, rollout.stats, mean_prompt, args.new_tokens)
    rows.append(("native engine", "bf16", seconds, others, flops / seconds))
    print(f"engine stats: {rollout.stats}")
    del rollout
    if not args.engine_only:
        rows.append(
            ("transformers generate", "bf16", *run_generate(model, tokenizer, prompts, params, args.repeats), None)
        )
        model = load_causal_lm(args.model, dtype=torch.float32).eval()
        rows.append(
            ("transformers generate", "fp32", *run_generate(model, tokenizer, prompts, params, args.repeats), None)
        )
    best_generate = min((r[2] for r in rows[1:]), default=None)
    print(
        f"\n{args.seqs} sequences ({args.seqs // args.group} prompts x {args.group}), "
        f"prompt {mean_prompt:.0f} tokens on average, "
        f"{args.new_tokens} new tokens each; bf16 matmul peak {peak / 1e9:.0f} GFLOP/s "
        f"(4096^3, other processes used {100 * peak_others:.0f}% of the CPUs meanwhile)\n"
    )
    header = (
        "| backend | dtype | seconds | generated tokens/s | speed-up vs best generate | achieved GFLOP/s (% of peak) |"
    )
    print(header + " CPU used by other processes |")
    print("| --- " * 7 + "|")
    for name, dtype, secs, others, achieved in rows:
        ratio = f"{best_generate / secs:.1f}x" if best_generate else "-"
        flop_cell = f"{achieved / 1e9:.0f} ({100 * achieved / peak:.0f}%)" if achieved else "-"
        print(
            f"| {name} | {dtype} | {secs:.2f} | {generated / secs:.0f} | {ratio} | {flop_cell} | {100 * others:.0f}% |"
        )
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
