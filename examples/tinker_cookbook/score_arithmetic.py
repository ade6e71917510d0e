"""Greedy accuracy on held-out arithmetic questions of models served by ``hybridflow serve``: the base model and
saved sampler weights (``tinker://`` paths, e.g. what a cookbook recipe saved), prompted as the recipes prompt
(the cookbook's renderer, ``role_colon`` by default) and scored by hybridflow's arithmetic scorer (the final number
of the answer), as ``make demo``'s held-out accuracy is.

    python examples/tinker_cookbook/score_arithmetic.py \\
        --tokenizer-dir ~/.cache/hybridflow/models/smollm2-135m-instruct --base-url http://127.0.0.1:8000 \\
        --model-name HuggingFaceTB/SmolLM2-135M-Instruct \\
        --path tinker://<model_id>/sampler_weights/final

with ``TINKER_API_KEY`` set to a key of the service. Needs ``make cookbook-env`` (the renderers).
"""

from __future__ import annotations

import argparse
import re
import sys


def questions(count: int, seed: int) -> list[tuple[str, str]]:
    """(question, answer) of the arithmetic task's test split, worded as offline_recipe.py words them for the RL and
    distillation recipes (without "Answer with just the number.")."""
    from hybridflow.data.tasks.arithmetic import make_rows

    out = []
    for row in make_rows(count, split="test", seed=seed):
        question = re.sub(r"\s*Answer with just the number\.?$", "", row["prompt"][-1]["content"])
        out.append((question, row["reward_model"]["ground_truth"]))
    return out


def accuracy(sampler, renderer, tokenizer, rows: list[tuple[str, str]], max_tokens: int) -> float:
    """The share of rows whose greedy answer's final number is right; the calls go out together (the service
    generates them as one batch)."""
    from tinker import types

    from hybridflow.reward import score_arithmetic

    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.get_stop_sequences())
    futures = [
        sampler.sample(
            renderer.build_generation_prompt([{"role": "user", "content": question}]),
            num_samples=1,
            sampling_params=params,
        )
        for question, _ in rows
    ]
    scores = []
    for future, (_, answer) in zip(futures, rows):
        text = tokenizer.decode(future.result().sequences[0].tokens, skip_special_tokens=True)
        scores.append(score_arithmetic(text, answer)["score"])
    return sum(scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-name", required=True, help="the served base model's name")
    parser.add_argument("--tokenizer-dir", required=True, help="the served model's directory (its tokenizer)")
    parser.add_argument("--path", action="append", default=[], help="saved sampler weights to score (repeatable)")
    parser.add_argument("--renderer", default="role_colon")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    import tinker
    from tinker_cookbook import renderers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir, local_files_only=True)
    renderer = renderers.get_renderer(args.renderer, tokenizer=tokenizer)
    service = tinker.ServiceClient(base_url=args.base_url)
    rows = questions(args.count, args.seed)
    targets = [("base", service.create_sampling_client(base_model=args.model_name))]
    targets += [(path, service.create_sampling_client(model_path=path)) for path in args.path]
    for name, sampler in targets:
        score = accuracy(sampler, renderer, tokenizer, rows, args.max_tokens)
        print(f"{score:.2f}  {name}  ({len(rows)} questions, greedy, {args.max_tokens} tokens)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
