"""`hybridflow measure`: a built-in task's test prompts generated and scored by the trainer's own parts."""

import re

from hybridflow.cli import main


def test_measure_scores_every_prompt_of_the_task(capsys):
    assert main(["measure", "arithmetic", "--model", "tiny-llama", "--n", "6", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    summary = re.search(
        r"arithmetic accuracy of tiny-llama: ([0-9.]+) on (\d+) test prompts \(greedy, 4 new tokens", out
    )
    assert summary, out
    assert summary.group(2) == "6" and 0.0 <= float(summary.group(1)) <= 1.0
    assert len(re.findall(r"^acc=", out, flags=re.M)) == 5  # --show 5 responses


def test_measure_asks_for_the_tools_of_a_multi_turn_task(capsys):
    assert main(["measure", "calculator", "--model", "tiny-llama", "--n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow: error: hybridflow measure: the calculator rows run an agent loop")
    assert "give its tools with --tools FILE" in err and "Traceback" not in err


def test_measure_runs_a_multi_turn_task_through_its_agent_loop(capsys):
    tools = "examples/tools/calculator.yaml"
    args = ["measure", "calculator", "--model", "tiny-llama", "--n", "2", "--tools", tools, "--max-new-tokens", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"calculator accuracy of tiny-llama: [0-9.]+ on 2 test prompts .*tool-call rate [0-9.]+", out), out


def test_measure_scores_a_data_file_per_data_source(tmp_path, capsys):
    """--data: a reasoning-gym mix's rows, accuracy and mean score printed per task."""
    from hybridflow.data.tasks import write_reasoning_gym
    from hybridflow.data.tasks.reasoning_gym import TaskSpec

    specs = [TaskSpec("chain_sum", config={"max_digits": 1}), TaskSpec("count_bits", config={"max_n": 255})]
    paths = write_reasoning_gym(specs, tmp_path, train=2, test=6, seed=0)
    args = ["measure", "--data", str(paths["test"]), "--model", "tiny-llama", "--n", "6", "--max-new-tokens", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    per_task = re.findall(r"^  reasoning_gym:(\w+): [0-9.]+ \(mean score [0-9.]+, (\d+) prompts\)$", out, flags=re.M)
    assert per_task and {name for name, _ in per_task} <= {"chain_sum", "count_bits"}
    assert sum(int(n) for _, n in per_task) == 6
    assert re.search(rf"{re.escape(str(paths['test']))} accuracy of tiny-llama: [0-9.]+ on 6 test prompts", out), out
    assert main(["measure", "arithmetic", "--data", str(paths["test"])]) == 2
    assert "name a built-in task or give --data FILE (one of the two)" in capsys.readouterr().err


def test_measure_refuses_rows_it_cannot_score_before_loading_a_model(tmp_path, capsys):
    from hybridflow.data.io import write_rows

    row = {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": ""}, "extra_info": {"i": 0}}
    for source, message in (
        ("verifiers:my_env", "name a verifiers environment's tasks, which its episodes score"),
        ("nowhere", "no reward scorer for data_source 'nowhere' (1 rows)"),
    ):
        path = write_rows([{**row, "data_source": source}], tmp_path / f"{source.replace(':', '_')}.parquet")
        assert main(["measure", "--data", str(path), "--model", "no-such-model"]) == 2
        assert message in capsys.readouterr().err
