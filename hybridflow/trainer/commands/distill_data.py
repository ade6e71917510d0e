"""``hybridflow distill-data``: a teacher's sampled answers to a prompt set, written as an SFT data set (or as
preference pairs).

    hybridflow distill-data arithmetic --model smollm2-135m-instruct --out data/distill.parquet --n 500 --samples 4
    hybridflow distill-data --data data/train.parquet --model runs/teacher/export --out distill.jsonl --keep correct
    hybridflow sft data.train_files=[data/distill.parquet] ...   # then fine-tune the student on them
    hybridflow distill-data arithmetic --model smollm2-135m-instruct --out pairs.parquet --samples 4 --format pairs

Off-policy distillation: the teacher answers each of the first N prompts K times (temperature T, seeded), and each
answer becomes one row of ``hybridflow sft``'s format: ``messages`` (the prompt's chat messages, then the answer as
the assistant message; SFT trains on the answer), ``data_source``, and ``extra_info`` with what the task's scorer
said of the answer (``score``, ``acc``, ...), ``sample`` (0..K-1), ``source_index`` (the prompt's row) and
``truncated`` (cut at --max-new-tokens without an end of turn; kept, and counted in the summary). ``--keep
correct`` keeps only the answers the scorer marks correct (rejection sampling). On-policy distillation (the student
samples, the teacher scores its tokens) is a training run instead (docs/distillation.md).

``--format pairs`` writes preference pairs instead (data/scored_pairs.py): for each prompt, an answer the scorer rated
higher chosen over one it rated lower, with the difference of their scores as the margin, for ``hybridflow dpo`` and
``hybridflow rm``. Generation and scoring are ``hybridflow measure``'s (generation_rows.py). Only single-turn rows: a
row that names an agent loop would need the tool messages in its conversation, which these rows do not keep.
"""

from __future__ import annotations

import numbers
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.validation import ArgumentParser, UserError

if TYPE_CHECKING:
    from hybridflow.protocol import DataProto
    from hybridflow.reward.manager import RewardResult

OUT_SUFFIXES = (".parquet", ".jsonl")
KEEP = ("all", "correct")
FORMATS = ("sft", "pairs")


def _parser() -> ArgumentParser:
    from hybridflow.data.tasks import TASKS

    parser = ArgumentParser(prog="hybridflow distill-data", description=__doc__)
    parser.add_argument("task", nargs="?", choices=sorted(TASKS), help="a built-in task (or give --data)")
    parser.add_argument("--data", default="", help="a parquet/jsonl file of prompt rows instead of a built-in task")
    parser.add_argument("--model", required=True, help="the teacher: a built-in name or a model folder")
    parser.add_argument("--out", required=True, help="the SFT data set to write (.parquet or .jsonl)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--n", type=int, default=100, help="prompts: the first N rows")
    parser.add_argument("--samples", type=int, default=1, help="answers per prompt (K)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the answer budget; longer ones are cut")
    parser.add_argument("--keep", default="all", choices=KEEP, help="every answer, or only the correct ones")
    parser.add_argument(
        "--format",
        default="sft",
        choices=FORMATS,
        help="sft: one SFT row per answer; pairs: preference pairs of a prompt's better- and worse-scored answers "
        "(hybridflow dpo, hybridflow rm)",
    )
    parser.add_argument("--pairs-per-prompt", type=int, default=1, help="--format pairs: most pairs per prompt")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (and a built-in task's seed)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--split", default="train", choices=["train", "test"], help="a built-in task's split")
    return parser


def _check_out(parser: ArgumentParser, out: Path, force: bool) -> None:
    """Refuse an output the command could not write, or one it would overwrite without --force."""
    if out.suffix not in OUT_SUFFIXES:
        parser.error(f"--out {out}: the suffix must be one of {', '.join(OUT_SUFFIXES)} (the format it is written in)")
    if out.is_dir():
        parser.error(f"--out {out} is a directory: give a file name ending in {' or '.join(OUT_SUFFIXES)}")
    if out.exists() and not force:
        parser.error(f"--out {out} exists: give another path, or --force to replace it")


def _check_args(parser, args) -> Path:
    """Every argument checked before a model is loaded (an error names it); the output path."""
    if args.format == "pairs" and (args.samples < 2 or args.keep != "all"):
        parser.error("--format pairs needs --samples 2 or more and --keep all: a pair is two answers to one prompt")
    counts = (("--n", args.n), ("--samples", args.samples), ("--max-new-tokens", args.max_new_tokens))
    for flag, value in (*counts, ("--pairs-per-prompt", args.pairs_per_prompt)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.temperature < 0:
        parser.error(f"--temperature must be 0 (greedy) or positive, got {args.temperature}")
    if bool(args.task) == bool(args.data):
        parser.error("name a built-in task or give --data FILE (one of the two)")
    out = Path(args.out).expanduser()
    _check_out(parser, out, args.force)
    return out


def main(argv: list[str] | None = None) -> int:
    from hybridflow.batch_keys import EXTRA_INFO
    from hybridflow.data.scored_pairs import pairs_from_samples
    from hybridflow.rollout.base import SamplingParams
    from hybridflow.trainer.commands.generation_rows import is_multi_turn, load_generator, scorable_rows

    parser = _parser()
    args = parser.parse_args(argv)
    out = _check_args(parser, args)

    start = time.time()
    rows = scorable_rows(parser, task=args.task, data=args.data, n=args.n, split=args.split, seed=args.seed)
    if is_multi_turn(rows):
        parser.error(
            f"the {args.task or args.data} rows run an agent loop (multi-turn, with tools); distill-data writes "
            "single-turn answers only: give rows without an agent_name"
        )
    generator = load_generator(args.model, args.dtype, rows)
    if args.temperature == 0:
        params = SamplingParams.greedy(max_new_tokens=args.max_new_tokens, seed=args.seed)
    else:
        params = SamplingParams(
            do_sample=True,
            temperature=args.temperature,
            top_p=1.0,
            top_k=-1,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
    batch, result = generator.generate(params, samples=args.samples)
    samples = sft_rows(batch, result, generator.tokenizer, args.samples)
    kept = [row for row in samples if args.keep == "all" or row[EXTRA_INFO]["acc"] == 1]
    if args.format == "pairs":
        kept = pairs_from_samples(samples, args.pairs_per_prompt)
        if not kept:
            raise UserError(
                f"hybridflow distill-data: every prompt's {args.samples} answers scored the same, so there is no "
                f"pair to write; nothing was written to {out}\n  fix: more --samples or a higher --temperature"
            )
    if not kept:
        raise UserError(
            f"hybridflow distill-data: the teacher answered none of the {len(samples)} samples correctly, so "
            f"--keep correct keeps nothing; nothing was written to {out}\n  fix: more --samples, a higher "
            "--max-new-tokens, a stronger --model, or --keep all"
        )
    write_atomically(kept, out)

    accs = [row[EXTRA_INFO]["acc"] for row in samples]
    truncated = sum(row[EXTRA_INFO]["truncated"] for row in samples)
    kept_text = f"{len(kept)} pairs" if args.format == "pairs" else f"kept {len(kept)} (--keep {args.keep})"
    print(
        f"distill-data: {len(samples) // args.samples} prompts x {args.samples} samples = {len(samples)} samples of "
        f"{args.model} (T={args.temperature:g}, {args.max_new_tokens} new tokens, {truncated} truncated); teacher "
        f"accuracy {sum(accs) / len(accs):.3f}; {kept_text}; {time.time() - start:.1f}s; "
        f"wrote {out}"
    )
    return 0


def sft_rows(batch: DataProto, result: RewardResult, tokenizer: Any, samples: int) -> list[dict[str, Any]]:
    """One SFT row per generated answer (the batch holds each prompt's ``samples`` answers next to each other):
    the prompt's messages and the answer as the assistant message, the answer's text without the end-of-turn
    token (the chat template writes that, and SFT trains on it)."""
    from hybridflow.batch_keys import DATA_SOURCE, EXTRA_INFO, INDEX, RAW_PROMPT, RESPONSE_MASK, RESPONSES, TRUNCATED

    responses, lengths = batch.batch[RESPONSES].cpu(), batch.batch[RESPONSE_MASK].sum(dim=1).tolist()
    truncated = batch.batch[TRUNCATED].tolist()
    scorer = {key: values for key, values in result.extra.items() if key != "failed"}
    rows = []
    for i in range(len(batch)):
        end = lengths[i] if truncated[i] else lengths[i] - 1  # an answer that ended: without its stop token
        answer = tokenizer.decode(responses[i, : max(end, 0)].tolist(), skip_special_tokens=True)
        said = {key: _plain(values[i]) for key, values in scorer.items()}
        rows.append(
            {
                "messages": [*batch.non_tensor_batch[RAW_PROMPT][i], {"role": "assistant", "content": answer}],
                DATA_SOURCE: str(batch.non_tensor_batch[DATA_SOURCE][i]),
                EXTRA_INFO: {
                    **{key: value for key, value in said.items() if value is not None},
                    "sample": i % samples,
                    "source_index": int(batch.non_tensor_batch[INDEX][i]),
                    "truncated": bool(truncated[i]),
                },
            }
        )
    return rows


def _plain(value: Any) -> str | float | bool | None:
    """A scorer's value as a plain scalar a data file can hold (numbers as floats), or None for anything else."""
    if isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def write_atomically(rows: list[dict[str, Any]], out: Path) -> Path:
    """``rows`` written to a temporary file next to ``out``, then renamed onto it: ``out`` is either the old file or
    the whole new one, never a partial write."""
    from hybridflow.data.io import write_rows

    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.stem}.{os.getpid()}.tmp{out.suffix}")  # write_rows goes by the suffix
    try:
        write_rows(rows, temporary)
        os.replace(temporary, out)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return out
