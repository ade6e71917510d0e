"""Run a tinker-cookbook recipe, unmodified, against ``hybridflow serve`` on a machine without a network.

The recipe's code runs as it is; this launcher only supplies what it would otherwise download:

- the tokenizer: ``--tokenizer-dir`` (the served model's directory) registered under the recipe's model name;
- the renderer name: ``--renderer`` (the recipe asks the cookbook's model table, which knows hub models only);
- the data set: ``datasets.load_dataset`` answers with the local rows of ``--data`` (a parquet or jsonl file);
  ``--make-data arithmetic`` writes such rows for sl_loop (conversations) or rl_loop (GSM8K-style questions) from
  hybridflow's built-in arithmetic task.

Everything after ``--`` goes to the recipe's own command line (chz: ``key=value``), e.g.

    python examples/tinker_cookbook/offline_recipe.py rl_loop --data runs/cookbook/arith_rl.parquet \\
        --tokenizer-dir ~/.cache/hybridflow/models/smollm2-135m-instruct -- \\
        base_url=http://127.0.0.1:8000 model_name=HuggingFaceTB/SmolLM2-135M-Instruct batch_size=8 \\
        group_size=8 loss_fn=importance_sampling max_steps=10 log_path=runs/cookbook/rl

with ``TINKER_API_KEY`` set to a key of the service (docs/serve.md).
"""

from __future__ import annotations

import argparse
import re
import runpy
import sys
from pathlib import Path

RECIPES = {
    "sl_loop": "tinker_cookbook.recipes.sl_loop",
    "rl_loop": "tinker_cookbook.recipes.rl_loop",
    "on_policy_distillation": "tinker_cookbook.recipes.distillation.on_policy_distillation",
}


def arithmetic_rows(recipe: str, count: int, seed: int) -> list[dict]:
    """Rows of hybridflow's arithmetic task in the shape the recipe reads: a conversation with the answer
    (sl_loop), or a question with a GSM8K-style answer ("#### 9") for rl_loop's grader (on_policy_distillation
    reads the question only, as it reads DeepMath's)."""
    from hybridflow.data.tasks.arithmetic import make_rows

    rows = []
    for row in make_rows(count, split="train", seed=seed):
        prompt = row["prompt"][-1]["content"]
        answer = row["reward_model"]["ground_truth"]
        if recipe == "sl_loop":
            rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
        else:
            question = re.sub(r"\s*Answer with just the number\.?$", "", prompt)
            rows.append({"question": question, "answer": f"#### {answer}"})
    return rows


def read_rows(path: Path) -> list[dict]:
    import pandas as pd

    frame = pd.read_json(path, lines=True) if path.suffix == ".jsonl" else pd.read_parquet(path)
    return frame.to_dict("records")


def install_stand_ins(tokenizer_dir: str, model_name: str, renderer: str, rows: list[dict]) -> None:
    import datasets
    from tinker_cookbook import model_info, tokenizer_utils
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer_utils.register_tokenizer(model_name, lambda: tokenizer)
    model_info.get_recommended_renderer_name = lambda name: renderer
    local = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})

    def load_dataset(*args, split: str | None = None, **kwargs):
        return local if split is None else local[split]  # the recipes ask for the train split only

    datasets.load_dataset = load_dataset


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    recipe_args = args[args.index("--") + 1 :] if "--" in args else []
    own = args[: args.index("--")] if "--" in args else args
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--data", type=Path, help="the local rows (parquet or jsonl)")
    parser.add_argument("--make-data", choices=["arithmetic"], help="write --data from a built-in task, then exit")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-dir", help="the served model's directory (its tokenizer)")
    parser.add_argument("--renderer", default="role_colon")
    parsed = parser.parse_args(own)
    if parsed.make_data:
        import pandas as pd

        parsed.data.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(arithmetic_rows(parsed.recipe, parsed.rows, parsed.seed)).to_parquet(parsed.data)
        print(f"wrote {parsed.rows} rows to {parsed.data}")
        return 0
    if parsed.data is None or parsed.tokenizer_dir is None:
        parser.error("--data and --tokenizer-dir are needed to run a recipe")
    model_name = next((a.split("=", 1)[1] for a in recipe_args if a.startswith("model_name=")), None)
    if model_name is None:
        parser.error("give the recipe's model_name=... after -- (the served model's name)")
    install_stand_ins(parsed.tokenizer_dir, model_name, parsed.renderer, read_rows(parsed.data))
    # the recipe's own `if __name__ == "__main__":` block runs, with its command line
    sys.argv = [RECIPES[parsed.recipe], *recipe_args]
    runpy.run_module(RECIPES[parsed.recipe], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
