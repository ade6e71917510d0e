"""``hybridflow sft``'s config errors come before Ray starts and before a model is built, naming the key, and write
nothing."""

import pytest
import ray
from cache_helpers import built_models
from test_sft_e2e import arguments, conversation_files

from hybridflow.trainer.commands.sft import SFT, run
from hybridflow.trainer.setup.sft_config import load_sft_config
from hybridflow.validation import ConfigError

pytestmark = pytest.mark.usefixtures("no_ray")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return conversation_files(tmp_path_factory.mktemp("sft_data"))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.train_batch_size=3", "data.train_batch_size"),  # 3 samples over 2 data-parallel ranks
        ("engine.tensor_model_parallel_size=3", "engine.tensor_model_parallel_size"),
        ("engine.ulysses_sequence_parallel_size=4", "engine.ulysses_sequence_parallel_size"),  # 2 ranks
        ("model.lora.rank=4", None),  # fine; with a target the model lacks:
        ("model.path=/nonexistent", "model.path"),
    ],
)
def test_config_errors_come_before_ray_naming_the_key(files, tmp_path, empty_model_cache, override, key):
    args = [*arguments(files, tmp_path / "run"), override]
    if key is None:
        args += ["model.lora.target_modules=[no_such_proj]"]
        key = "model.lora.target_modules"
    with pytest.raises(ConfigError, match=rf"^config key '{key}'"):
        run(load_sft_config(args))
    assert not ray.is_initialized()
    assert not (tmp_path / "run").exists()  # nothing written
    assert built_models(empty_model_cache) == []  # and no model built


def test_the_sequence_parallel_key_makes_the_layout(files, tmp_path):
    """engine.ulysses_sequence_parallel_size=2 on the 2 ranks: one data-parallel rank whose 2 ranks split each
    micro-batch's tokens (tests/workers/test_sequence_parallel_workers.py: what the workers do with it)."""
    plan = SFT.check(load_sft_config([*arguments(files, tmp_path / "run"), "engine.ulysses_sequence_parallel_size=2"]))
    assert (plan.layout.dp, plan.layout.sp, plan.layout.t) == (1, 2, 1)
    assert not ray.is_initialized()


def test_a_reward_model_in_stages_refuses_ulysses_before_ray(tmp_path):
    """``hybridflow rm`` reads each pair's scores at one token a row: in pipeline stages under Ulysses no rank holds
    it whole, so the layout is refused before Ray, naming the key."""
    from hybridflow.data.io import write_rows
    from hybridflow.trainer.commands.rm import RM
    from hybridflow.trainer.setup.rm_config import load_rm_config

    pair = {"prompt": [{"role": "user", "content": "1+1?"}], "chosen": "2", "rejected": "3"}
    train = write_rows([pair] * 8, tmp_path / "train.jsonl")
    args = [
        f"data.train_files=[{train}]",
        "data.train_batch_size=4",
        "trainer.n_workers_per_node=4",
        "engine.micro_batch_size_per_gpu=1",
        "engine.pipeline_model_parallel_size=2",
        "engine.ulysses_sequence_parallel_size=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(ConfigError, match=r"^config key 'engine.ulysses_sequence_parallel_size'.*in stages"):
        RM.check(load_rm_config(args))
    assert not ray.is_initialized()
