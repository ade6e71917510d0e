"""Every command's input errors: one message naming the key or the file (and the fix), exit code 2, no
traceback, before Ray starts, in seconds. The files are made broken here in every way a user's could be."""

import json
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from cache_helpers import built_models

from hybridflow.cli import main as cli
from hybridflow.models import resolve_model_path

# checks that nothing started Ray, or runs that start and end their own cluster: the shared one (tests/conftest.py)
# is shut down first
pytestmark = pytest.mark.usefixtures("no_ray")

TOOL_WITHOUT_SCHEMA = """from hybridflow.tools.base import Tool


class NoSchema(Tool):
    async def execute(self, instance_id, arguments):
        return None
"""


def fails_cleanly(args: list[str], capsys) -> str:
    """``hybridflow ARGS`` in this process: exit 2 within 10 s, one message (and its fix), before Ray."""
    start = time.perf_counter()
    code = cli(args)
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("hybridflow: error: ") and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) <= 3 and all(line.startswith(("hybridflow: error: ", "  ")) for line in lines[1:]), err
    assert not ray.is_initialized()
    assert elapsed < 10, elapsed
    return err


@pytest.fixture(scope="module")
def broken(tmp_path_factory, arithmetic_files):
    """Files broken the ways a user's can be, by name."""
    out = tmp_path_factory.mktemp("broken")
    files = {
        "bad_yaml": "data:\n  train_batch_size: [1\n",
        "list_yaml": "- data\n- trainer\n",
        "tools_bad_yaml": "tools:\n  - name: calculator\n    config: {a: [1}\n",
        "tools_empty": "tools: []\n",
        "tool_module.py": TOOL_WITHOUT_SCHEMA,
        "bad_lines.jsonl": '{"prompt": [{"role": "user", "content": "hi"}]}\nnot json\n',
    }
    paths = {}
    for name, text in files.items():
        path = out / (name if "." in name else f"{name}.yaml")
        path.write_text(text)
        paths[name] = path
    paths["tools_no_schema"] = out / "tools_no_schema.yaml"
    paths["tools_no_schema"].write_text(f"tools:\n  - class: {paths['tool_module.py']}:NoSchema\n")
    paths["empty.parquet"] = out / "empty.parquet"
    paths["empty.parquet"].write_bytes(b"")
    paths["corrupt.parquet"] = out / "corrupt.parquet"
    paths["corrupt.parquet"].write_bytes(b"PAR1 not a parquet file")
    paths["no_rows.parquet"] = out / "no_rows.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), paths["no_rows.parquet"])
    paths["no_prompt.jsonl"] = out / "no_prompt.jsonl"
    row = {"question": "2+2?", "data_source": "arithmetic", "reward_model": {"ground_truth": "4"}}
    paths["no_prompt.jsonl"].write_text(json.dumps(row) + "\n")
    paths["no_data_source.jsonl"] = out / "no_data_source.jsonl"
    row = {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}
    paths["no_data_source.jsonl"].write_text(json.dumps(row) + "\n")
    paths["train"], paths["test"] = arithmetic_files
    paths["run"] = out / "run"
    return paths


def train(broken, *extra: str) -> list[str]:
    return [
        "train",
        f"data.train_files=[{broken['train']}]",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={broken['run']}",
        *extra,
    ]


MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"


@pytest.mark.parametrize(
    "make_args, expected",
    [
        (lambda b: ["train", "--config", str(b["bad_yaml"])], "bad_yaml.yaml' (--config): cannot be read (ParserError"),
        (lambda b: ["train", "--config", str(b["list_yaml"])], "list_yaml.yaml' (--config): is not a mapping"),
        (lambda b: ["train", "--config", "/no/such.yaml"], "file '/no/such.yaml' (--config): does not exist"),
        (lambda b: train(b, "data.val_files=[a"), "config key 'data.val_files': '[a' is not a YAML value"),
        (
            lambda b: train(b, f"{MULTI_TURN}.enable=true", f"{MULTI_TURN}.tool_config_path={b['tools_bad_yaml']}"),
            "tools_bad_yaml.yaml' (multi_turn.tool_config_path): cannot be read",
        ),
        (
            lambda b: train(b, f"{MULTI_TURN}.enable=true", f"{MULTI_TURN}.tool_config_path={b['tools_empty']}"),
            "tools_empty.yaml: expected a top-level 'tools:' list with at least one tool",
        ),
        (
            lambda b: train(b, f"{MULTI_TURN}.enable=true", f"{MULTI_TURN}.tool_config_path={b['tools_no_schema']}"),
            "tools_no_schema.yaml: tools[0].class",
        ),
        (
            lambda b: train(b, f"data.train_files=[{b['no_prompt.jsonl']}]"),
            "no_prompt.jsonl' (data.train_files): row 0: column 'prompt' (data.prompt_key)",
        ),
        (
            lambda b: train(b, f"data.train_files=[{b['no_data_source.jsonl']}]"),
            "no_data_source.jsonl' (data.train_files): row 0 has no 'data_source' column",
        ),
        (
            lambda b: train(b, f"data.val_files=[{b['bad_lines.jsonl']}]"),
            "bad_lines.jsonl' (data.val_files): cannot be read",
        ),
        (lambda b: train(b, f"data.train_files=[{b['empty.parquet']}]"), "empty.parquet' (data.train_files)"),
        (lambda b: train(b, f"data.train_files=[{b['corrupt.parquet']}]"), "corrupt.parquet' (data.train_files)"),
        (lambda b: train(b, f"data.train_files=[{b['no_rows.parquet']}]"), "no_rows.parquet' (data.train_files)"),
        (lambda b: train(b, "data.max_prompt_length=3"), "config key 'data.max_prompt_length': every prompt"),
        (lambda b: train(b, "data.train_batch_size=5000"), "config key 'data.train_batch_size'"),
        (lambda b: ["plan", "--nodes", "abc"], "--nodes abc: give a positive whole number"),
        (lambda b: ["plan", "--top", "0"], "--top 0: give a positive whole number"),
        (lambda b: ["plan", "--config", "/no/plan.yaml"], "file '/no/plan.yaml' (--config): does not exist"),
        (lambda b: ["plan", "--bogus"], "unknown option --bogus"),
        (lambda b: ["plan", "actor_rollout_ref.model.path=/no/model"], "config key 'actor_rollout_ref.model.path'"),
        (lambda b: ["measure", "nope"], "hybridflow measure: argument task: invalid choice: 'nope'"),
        (lambda b: ["measure", "arithmetic", "--n", "many"], "argument --n: invalid int value: 'many'"),
        (lambda b: ["measure", "arithmetic", "--model", "/no/model"], "file '/no/model' (--model): does not exist"),
        (lambda b: ["measure", "arithmetic", "--n", "0"], "--n must be at least 1, got 0"),
        (lambda b: ["measure", "arithmetic", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (lambda b: ["report", "/no/run"], "file '/no/run/metrics.jsonl': not found"),
        (lambda b: ["report"], "hybridflow report: the following arguments are required: run_dir"),
    ],
)
def test_a_bad_input_is_one_message_and_exit_2(broken, capsys, empty_model_cache, make_args, expected):
    assert expected in fails_cleanly(make_args(broken), capsys)
    # found before any model is built, but for what the tokenizer tells: the prompts' lengths, the rows they leave
    if expected not in NEEDS_THE_TOKENIZER:
        assert built_models(empty_model_cache) == []


NEEDS_THE_TOKENIZER = ("config key 'data.max_prompt_length': every prompt", "config key 'data.train_batch_size'")


def test_vllm_limits_are_checked_before_ray(broken, capsys):
    """What vLLM would refuse only inside the workers, after Ray started: named before, with the key."""
    head_32 = resolve_model_path("tiny-llama", num_attention_heads=2, num_key_value_heads=1)
    vllm = train(broken, "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={head_32}")
    vllm += [
        "actor_rollout_ref.rollout.vllm.max_num_batched_tokens=2048",
        "actor_rollout_ref.rollout.vllm.max_num_seqs=8",
    ]
    err = fails_cleanly([*vllm, "actor_rollout_ref.rollout.vllm.max_num_seqs=4096"], capsys)
    assert "config key 'actor_rollout_ref.rollout.vllm.max_num_batched_tokens': 2048 is below" in err
    err = fails_cleanly([*vllm, "actor_rollout_ref.rollout.vllm.max_model_len=128"], capsys)
    assert "config key 'actor_rollout_ref.rollout.vllm.max_model_len': a sequence of" in err
    assert "320 tokens does not fit vLLM's context of 128 tokens" in err  # 256 prompt + 64 response
    err = fails_cleanly([*vllm, "actor_rollout_ref.rollout.vllm.kv_cache_gb=0.0001"], capsys)
    assert "config key 'actor_rollout_ref.rollout.vllm.kv_cache_gb': 0.0001 GiB holds" in err


def test_the_task_writer_reports_like_the_commands(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.data.tasks", "arithmetic", "--out", str(tmp_path), "--train", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hybridflow: error: python -m hybridflow.data.tasks: argument --train: 0 rows: give a positive count "
        "(see python -m hybridflow.data.tasks --help)"
    ]
