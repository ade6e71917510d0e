"""One multi-turn `extend` call: padded rows and SDPA against the packed real tokens through the ragged kernel
(run by hand).

    .venv/bin/python bench/extend_packed.py
    .venv/bin/python bench/extend_packed.py --rows 64 --cases 150:20,300:100

smollm2-135m-instruct in bf16, `--rows` rows that each hold `cached` positions and append `new` tokens, for each
`cached:new` of `--cases`: once with every row the same, once with each row's cached and new counts drawn
between half and all of the figure (seeded), as turns of real conversations differ. Best of `--repeats` calls
of each path (`model.extend` with ragged False and True), all in this process. The engine uses the packed path
only up to `model.RAGGED_EXTEND_MAX_TOKENS` new tokens per row; here both run at every size, to show where the
bound belongs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.native import NativeRollout, model
from hybridflow.trainer.setup.config import default_config


def extend_ms(engine, tokens, lengths, starts, slots, ragged: bool, repeats: int) -> float:
    """Best of ``repeats`` calls of one extend, after one untimed (the scratch slot is the one after the rows)."""
    best = float("inf")
    for call in range(repeats + 1):
        start = time.perf_counter()
        with torch.inference_mode():
            model.extend(engine.weights, engine.rope, engine.cache, tokens, lengths, starts, slots, len(slots), ragged)
        if call:
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cases", default="150:20,150:60,300:20,300:100,0:400")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model.RAGGED_EXTEND_MAX_TOKENS = 1 << 30  # the packed path at every size, not only where the engine takes it
    cases = [tuple(int(n) for n in case.split(":")) for case in args.cases.split(",")]
    name = "smollm2-135m-instruct"
    rollout = NativeRollout(
        load_causal_lm(name, dtype=torch.bfloat16),
        load_tokenizer(name),
        engine_config=default_config().actor_rollout_ref.rollout.native,
    )
    engine, rows = rollout.engine, args.rows
    engine.prepare(rows + 1, max(cached + new for cached, new in cases) + 1)
    print(f"load average {os.getloadavg()[0]:.2f}; {rows} rows, {args.threads} threads, bf16")
    print("| cached positions | new tokens per row | rows | tokens | padded (ms) | packed (ms) | packed vs padded |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for cached, new in cases:
        for varied in (False, True):
            generator = torch.Generator().manual_seed(0)
            if varied:
                starts = torch.randint(cached // 2, cached + 1, (rows,), generator=generator)
                lengths = torch.randint(max(1, new // 2), new + 1, (rows,), generator=generator)
            else:
                starts, lengths = torch.full((rows,), cached), torch.full((rows,), new)
            tokens = torch.randint(0, 1000, (rows, int(lengths.max())), generator=generator)
            slots = torch.arange(rows)
            padded = extend_ms(engine, tokens, lengths, starts, slots, False, args.repeats)
            packed = extend_ms(engine, tokens, lengths, starts, slots, True, args.repeats)
            kind = "varied" if varied else "equal"
            print(
                f"| {cached} | {new} | {kind} | {int(lengths.sum())} | {padded:.1f} | {packed:.1f} "
                f"| {padded / packed:.2f}x |"
            )


if __name__ == "__main__":
    main()
