"""load_custom_reward_fn: a user file's function, and errors that name the key to fix."""

import pytest
from reward_configs import TOLERANT

from hybridflow.reward import RewardManager, load_custom_reward_fn

SOURCE = """
LIMIT = 3

def length_reward(data_source, solution_str, ground_truth, extra_info):
    return {"score": min(len(solution_str), LIMIT) / LIMIT, "source": data_source}

def _helper():
    pass
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SOURCE)
    return path


def test_loads_the_named_function(reward_file):
    fn = load_custom_reward_fn(str(reward_file), "length_reward")
    assert fn("gsm8k", "abcdef", "1", None) == {"score": 1.0, "source": "gsm8k"}
    assert fn("gsm8k", "a", "1", None)["score"] == pytest.approx(1 / 3)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"custom_reward_function\.path"):
        load_custom_reward_fn(str(tmp_path / "nope.py"), "length_reward")


def test_missing_function_lists_what_is_defined(reward_file):
    with pytest.raises(AttributeError, match=r"custom_reward_function\.name") as error:
        load_custom_reward_fn(str(reward_file), "reward")
    assert "length_reward" in str(error.value) and "_helper" not in str(error.value)


def test_not_callable(reward_file):
    with pytest.raises(TypeError, match=r"custom_reward_function\.name"):
        load_custom_reward_fn(str(reward_file), "LIMIT")


def test_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_module_here\n")
    with pytest.raises(ImportError, match="broken.py"):
        load_custom_reward_fn(str(path), "f")


def test_the_manager_uses_it(reward_file, make_batch, tiny_tokenizer):
    fn = load_custom_reward_fn(str(reward_file), "length_reward")
    batch = make_batch(tiny_tokenizer, ["abc", "a"], ["s1", "s2"], ["", ""])
    result = RewardManager(tiny_tokenizer, TOLERANT, custom_fn=fn)(batch)
    assert result.extra["score"] == pytest.approx([1.0, 1 / 3])
    assert result.extra["source"] == ["s1", "s2"]
