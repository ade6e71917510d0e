"""Measure a model's starting accuracy on a built-in task's test split (greedy decoding).

    python -m hybridflow.data.tasks.measure arithmetic --model smollm2-135m-instruct --n 100

A calibration tool, not library code (it is why the task difficulty is what it is), so it
reaches past the data layer: it loads the model from hybridflow.models and scores with the
registered scorer from hybridflow.reward.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    import torch

    from hybridflow.batch_keys import ATTENTION_MASK, DATA_SOURCE, EXTRA_INFO, INPUT_IDS, REWARD_MODEL
    from hybridflow.data import DatasetConfig, RLHFDataset
    from hybridflow.data.io import write_rows
    from hybridflow.data.tasks import TASKS, make_task_rows
    from hybridflow.models import load_causal_lm, load_tokenizer
    from hybridflow.reward import get_scorer

    parser = argparse.ArgumentParser(prog="python -m hybridflow.data.tasks.measure", description=__doc__)
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or local HF folder")
    parser.add_argument("--n", type=int, default=100, help="test prompts to score")
    parser.add_argument("--seed", type=int, default=0, help="the task seed (as for the generator CLI)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--show", type=int, default=5, help="print this many responses")
    args = parser.parse_args(argv)

    start = time.time()
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_rows(make_task_rows(args.task, args.n, "test", args.seed), Path(tmp) / "test.parquet")
        dataset = RLHFDataset(
            path, tokenizer, DatasetConfig(prompt_key="prompt", max_prompt_length=1024, filter_overlong_prompts=True)
        )
    loaded = time.time()

    scores, by_level = [], defaultdict(list)
    for first in range(0, len(dataset), args.batch_size):
        batch = dataset.collate([dataset[i] for i in range(first, min(first + args.batch_size, len(dataset)))])
        inputs = batch.batch[INPUT_IDS].to(args.device)
        with torch.no_grad():
            output = model.generate(
                input_ids=inputs,
                attention_mask=batch.batch[ATTENTION_MASK].to(args.device),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(output[:, inputs.shape[1] :], skip_special_tokens=True)
        for i, text in enumerate(texts):
            source, truth = batch.non_tensor_batch[DATA_SOURCE][i], batch.non_tensor_batch[REWARD_MODEL][i]
            result = get_scorer(source)(text, truth["ground_truth"], batch.non_tensor_batch[EXTRA_INFO][i])
            acc = float(result["acc"] if isinstance(result, dict) else result)
            scores.append(acc)
            by_level[batch.non_tensor_batch[EXTRA_INFO][i].get("level", "all")].append(acc)
            if len(scores) <= args.show:
                print(f"truth={truth['ground_truth']!r} response={text!r} acc={acc}")
    done = time.time()
    for level, accs in sorted(by_level.items()):
        print(f"  {level}: {sum(accs) / len(accs):.2f} ({len(accs)} prompts)")
    print(
        f"{args.task} accuracy of {args.model}: {sum(scores) / len(scores):.3f} on {len(scores)} test prompts "
        f"(greedy, {args.max_new_tokens} new tokens, batch {args.batch_size}, {args.dtype}, {args.device}); "
        f"load {loaded - start:.1f}s, generate+score {done - loaded:.1f}s"
    )


if __name__ == "__main__":
    main()
