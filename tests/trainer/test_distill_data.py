"""`hybridflow distill-data`: a teacher's answers to a task's prompts as SFT rows, checked against the tiny model's
own greedy tokens (transformers, fp32), the arithmetic scorer and SFTDataset's loss mask."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.cli import main
from hybridflow.data import SFTDataset
from hybridflow.data.io import read_rows, write_rows
from hybridflow.data.scored_pairs import pairs_from_samples
from hybridflow.data.sft_dataset import LOSS_MASK, PROMPT_IDS, RESPONSE_IDS
from hybridflow.data.tasks import make_task_rows
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.reward.scorers.arithmetic import score_arithmetic
from hybridflow.trainer.setup.sft_config import load_sft_config


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


def distill(capsys, *args: str, model: str = "tiny-llama") -> str:
    """Run the command (it must succeed) and return its summary line."""
    assert main(["distill-data", "--model", model, *args]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def answers(rows: list[dict]) -> list[str]:
    return [row["messages"][-1]["content"] for row in rows]


def acc(row: dict, ground_truth: str) -> float:
    """The arithmetic scorer's verdict on a row's answer."""
    return score_arithmetic(row["messages"][-1]["content"], ground_truth)["acc"]


def test_keep_all_writes_a_row_per_sample_that_sft_trains_on_the_answer(tmp_path, capsys, tokenizer):
    out = tmp_path / "distill.parquet"
    summary = distill(capsys, "arithmetic", "--out", str(out), "--n", "3", "--samples", "2", "--seed", "0")
    assert summary.startswith("distill-data: 3 prompts x 2 samples = 6 samples of tiny-llama (T=1, 32 new tokens")
    assert "kept 6 (--keep all)" in summary and summary.endswith(f"wrote {out}")

    rows, prompts = read_rows(out), make_task_rows("arithmetic", 3, "train", 0)
    assert len(rows) == 6
    for i, row in enumerate(rows):
        prompt, sample = i // 2, i % 2
        assert row["messages"][:-1] == prompts[prompt]["prompt"]
        assert row["messages"][-1]["role"] == "assistant"
        assert row["data_source"] == "arithmetic"
        info = row["extra_info"]
        assert (info["source_index"], info["sample"]) == (prompt, sample)
        assert info["acc"] == acc(row, prompts[prompt]["reward_model"]["ground_truth"])
        assert isinstance(info["truncated"], bool)
    assert all(a != b for a, b in zip(answers(rows)[::2], answers(rows)[1::2]))  # K samples at T=1 differ
    truncated = sum(row["extra_info"]["truncated"] for row in rows)
    assert 0 < truncated < 6 and f"{truncated} truncated)" in summary  # answers that ended, and answers cut

    # `hybridflow sft` reads the file as it is: the prompt is the templated question, the loss covers the answer
    # and the end of its turn, nothing else
    data = load_sft_config([f"data.train_files=[{out}]"]).data
    dataset = SFTDataset(data.train_files, tokenizer, data)
    assert len(dataset) == 6
    for sample, row in zip(dataset, rows, strict=True):
        context = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(sample[PROMPT_IDS]) == context
        trained = [t for t, m in zip(sample[RESPONSE_IDS], sample[LOSS_MASK]) if m]
        assert tokenizer.decode(trained) == row["messages"][-1]["content"] + tokenizer.eos_token
        first_untrained = sample[LOSS_MASK].index(0) if 0 in sample[LOSS_MASK] else len(sample[LOSS_MASK])
        assert not any(sample[LOSS_MASK][first_untrained:])  # one trained span, from the answer's first token


def _greedy(model, ids: list[int], budget: int, stop: int) -> tuple[list[int], bool]:
    """transformers' forward, one argmax at a time: (the answer's tokens without the stop token, cut at budget)."""
    tokens = []
    with torch.no_grad():
        for _ in range(budget):
            tokens.append(int(model(torch.tensor([ids + tokens])).logits[0, -1].argmax()))
            if tokens[-1] == stop:
                return tokens[:-1], False
    return tokens, True


def test_greedy_answers_are_the_models_own_tokens(tmp_path, capsys, tokenizer):
    """A teacher from a model folder; greedy, its answers are transformers' argmax tokens. The random tiny model never
    ends a turn, so the teacher's end-of-turn row of lm_head is made a copy (x1.05) of a token its first answer
    holds: some answers now end there (the stop token not in the answer), others are cut at the budget."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"), dtype=torch.float32).eval()
    prompts = make_task_rows("arithmetic", 4, "test", 0)
    contexts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(p["prompt"], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for p in prompts
    ]
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.lm_head.weight[eos] = 1.05 * model.lm_head.weight[_greedy(model, contexts[0], 12, eos)[0][3]]
    teacher = tmp_path / "teacher"
    model.save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)

    out = tmp_path / "greedy.jsonl"
    data = write_rows(prompts, tmp_path / "prompts.jsonl")
    greedy = ["--temperature", "0", "--max-new-tokens", "12", "--dtype", "float32"]
    args = ["--data", str(data), "--out", str(out), *greedy]
    summary = distill(capsys, *args, model=str(teacher))
    rows = read_rows(out)
    assert [row["messages"][:-1] for row in rows] == [p["prompt"] for p in prompts]
    for row, context in zip(rows, contexts, strict=True):
        tokens, cut = _greedy(model, context, 12, eos)
        assert row["messages"][-1]["content"] == tokenizer.decode(tokens, skip_special_tokens=True)
        assert row["extra_info"]["truncated"] == cut
    assert {row["extra_info"]["truncated"] for row in rows} == {True, False}
    assert "12 new tokens, 1 truncated)" in summary


def test_the_seed_decides_the_samples(tmp_path, capsys):
    """Same prompts (a data file): the same seed writes the same bytes, another seed other answers."""
    data = write_rows(make_task_rows("arithmetic", 3, "test", 0), tmp_path / "prompts.jsonl")
    common = ["--data", str(data), "--samples", "2", "--max-new-tokens", "8"]
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        distill(capsys, *common, "--seed", seed, "--out", str(tmp_path / f"{name}.jsonl"))
    a, b, c = (tmp_path / f"{name}.jsonl" for name in "abc")
    assert a.read_bytes() == b.read_bytes()
    rows_a, rows_c = read_rows(a), read_rows(c)
    assert [r["messages"][:-1] for r in rows_a] == [r["messages"][:-1] for r in rows_c]
    assert answers(rows_a) != answers(rows_c)


def test_keep_correct_keeps_exactly_the_right_answers(tmp_path, capsys):
    """Rejection sampling. The ground truths are chosen so that some samples are right: each even prompt's answer
    is the last number its first sample gave (the tiny model's answers are random)."""
    rows = make_task_rows("arithmetic", 4, "test", 0)
    data = write_rows(rows, tmp_path / "prompts.parquet")
    common = ["--samples", "3", "--max-new-tokens", "16", "--seed", "3"]
    distill(capsys, "--data", str(data), *common, "--out", str(tmp_path / "all.jsonl"))
    sampled = read_rows(tmp_path / "all.jsonl")
    first = {r["extra_info"]["source_index"]: r for r in sampled if r["extra_info"]["sample"] == 0}
    for i, row in enumerate(rows):
        pred = first[i]["extra_info"]["pred"]
        row["reward_model"] = {**row["reward_model"], "ground_truth": pred if i % 2 == 0 and pred else "-1"}
    assert any(row["reward_model"]["ground_truth"] != "-1" for row in rows), "no sample held a number"
    data = write_rows(rows, tmp_path / "graded.parquet")

    out = tmp_path / "correct.jsonl"
    summary = distill(capsys, "--data", str(data), *common, "--keep", "correct", "--out", str(out))
    # the same prompts and seed: the same answers as all.jsonl's, of which only the right ones are kept
    truths = [row["reward_model"]["ground_truth"] for row in rows]
    right = [r for r in sampled if acc(r, truths[r["extra_info"]["source_index"]]) == 1]
    kept = read_rows(out)
    assert 0 < len(kept) < len(sampled)
    assert [(r["extra_info"]["source_index"], r["extra_info"]["sample"]) for r in kept] == [
        (r["extra_info"]["source_index"], r["extra_info"]["sample"]) for r in right
    ]
    assert answers(kept) == answers(right) and all(r["extra_info"]["acc"] == 1 for r in kept)
    assert f"teacher accuracy {len(right) / len(sampled):.3f}; kept {len(kept)} (--keep correct)" in summary

    # none right: nothing to write, and the file already there stays as it was
    for row in rows:
        row["reward_model"] = {**row["reward_model"], "ground_truth": "-1"}
    data = write_rows(rows, tmp_path / "none.parquet")
    args = ["--data", str(data), *common, "--keep", "correct", "--out", str(out), "--force"]
    assert main(["distill-data", "--model", "tiny-llama", *args]) == 2
    assert "answered none of the 12 samples correctly" in capsys.readouterr().err
    assert answers(read_rows(out)) == answers(kept)


def test_pairs_hold_a_better_scored_answer_over_a_worse_one_of_the_same_samples(tmp_path, capsys):
    """--format pairs: the same prompts and seed give the same samples as --format sft, paired by their scores
    (data/scored_pairs.py, tested by hand); the ground truths make some samples right, as in the test above."""
    rows = make_task_rows("arithmetic", 4, "test", 0)
    common = ["--samples", "3", "--max-new-tokens", "16", "--seed", "3"]
    distill(
        capsys, "--data", str(write_rows(rows, tmp_path / "p.parquet")), *common, "--out", str(tmp_path / "a.jsonl")
    )
    first = {
        r["extra_info"]["source_index"]: r for r in read_rows(tmp_path / "a.jsonl") if r["extra_info"]["sample"] == 0
    }
    for i, row in enumerate(rows):
        pred = first[i]["extra_info"]["pred"]
        row["reward_model"] = {**row["reward_model"], "ground_truth": pred or "-1"}
    data = str(write_rows(rows, tmp_path / "graded.parquet"))
    distill(capsys, "--data", data, *common, "--out", str(tmp_path / "all.jsonl"))
    out = tmp_path / "pairs.jsonl"
    summary = distill(capsys, "--data", data, *common, "--format", "pairs", "--out", str(out))
    pairs = read_rows(out)
    assert pairs == pairs_from_samples(read_rows(tmp_path / "all.jsonl"))
    assert pairs and f"; {len(pairs)} pairs;" in summary
    for pair in pairs:
        truth = rows[pair["extra_info"]["source_index"]]["reward_model"]["ground_truth"]
        assert score_arithmetic(pair["chosen"], truth)["score"] > score_arithmetic(pair["rejected"], truth)["score"]
        assert pair["margin"] > 0


def _refusals(tmp_path: Path) -> list[tuple[list[str], str]]:
    unscorable = {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": ""}}
    nowhere = write_rows([{**unscorable, "data_source": "nowhere"}], tmp_path / "nowhere.parquet")
    return [
        (["--data", str(tmp_path / "missing.parquet")], "(--data): does not exist"),
        (["--data", str(nowhere)], "no reward scorer for data_source 'nowhere' (1 rows)"),
        (["arithmetic", "--samples", "0"], "--samples must be at least 1, got 0"),
        (["arithmetic", "--format", "pairs"], "--format pairs needs --samples 2 or more"),
        (
            ["calculator"],
            "the calculator rows run an agent loop (multi-turn, with tools); distill-data writes single-turn",
        ),
    ]


def test_refusals_come_before_a_model_loads_and_keep_the_file_there(tmp_path, capsys):
    """Each mistake is one message; the teacher named does not exist, so each is found before a model loads."""
    existing = tmp_path / "kept.jsonl"
    existing.write_text('{"messages": "already written"}\n')
    no_model = ["distill-data", "--model", "no-such-model"]
    cases = [([*args, "--out", str(existing), "--force"], message) for args, message in _refusals(tmp_path)]
    cases += [
        (
            ["arithmetic", "--out", str(existing)],
            f"--out {existing} exists: give another path, or --force to replace it",
        ),
        (["arithmetic", "--out", str(tmp_path / "rows.csv")], "the suffix must be one of .parquet, .jsonl"),
    ]
    for args, message in cases:
        assert main([*no_model, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("hybridflow: error: ") and message in err and "Traceback" not in err, (args, err)
        assert json.loads(existing.read_text()) == {"messages": "already written"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.jsonl", "nowhere.parquet"]  # no temporary left
