"""A teacher must share its student's tokenizer: each difference found and named, and the run refusing before Ray."""

import json
import shutil

import pytest

from hybridflow.models import resolve_model_path
from hybridflow.models.tokenizer_match import tokenizer_differences
from hybridflow.trainer.setup.config import ConfigError, load_config
from hybridflow.trainer.setup.role_parts import check_teacher_tokenizer
from hybridflow.trainer.setup.run_plan import make_run_plan


@pytest.fixture
def student_copy(tmp_path):
    """A copy of tiny-llama's directory, to change one thing of."""
    copy = tmp_path / "teacher"
    shutil.copytree(resolve_model_path("tiny-llama"), copy)
    return copy


def test_the_same_family_of_another_seed_shares_the_tokenizer():
    assert tokenizer_differences("tiny-llama", resolve_model_path("tiny-llama", seed=1)) == []


def test_a_larger_vocabulary_is_named_with_tokens_of_its_own():
    (difference,) = tokenizer_differences("tiny-llama", resolve_model_path("tiny-llama", vocab_size=600))
    assert difference.startswith("vocabulary: 512 tokens against 600; only the teacher's: [")


def test_another_architecture_with_the_same_tokenizer_files_shares_it():
    # tiny-qwen2's tokenizer files are tiny-llama's, byte for byte; transformers fills Qwen2's class default unk_token
    # in for one of them, which decides no token id
    assert tokenizer_differences("tiny-llama", "tiny-qwen2") == []


def other_eos(directory):
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(settings | {"eos_token": "<|endoftext|>"}))


def test_other_special_tokens_are_named_with_their_ids(student_copy):
    other_eos(student_copy)
    vocabulary = json.loads((student_copy / "tokenizer.json").read_text())["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads((student_copy / "tokenizer.json").read_text())["added_tokens"]}
    ids = vocabulary | added
    (difference,) = tokenizer_differences("tiny-llama", student_copy)
    assert difference == (
        f"special tokens (1 differ): eos_token: '<|im_end|> (id {ids['<|im_end|>']})' against "
        f"'<|endoftext|> (id {ids['<|endoftext|>']})'"
    )


def test_other_merges_are_named(student_copy):
    tokenizer = json.loads((student_copy / "tokenizer.json").read_text())
    merges = tokenizer["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]  # the same vocabulary, another order of merging: other ids for a text
    (student_copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert tokenizer_differences("tiny-llama", student_copy) == ["tokenizer.json: its model differ (other merges)"]


def test_another_chat_template_and_a_smaller_embedding(student_copy):
    (student_copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = json.loads((student_copy / "config.json").read_text())
    (student_copy / "config.json").write_text(json.dumps(config | {"vocab_size": 500}))
    assert tokenizer_differences("tiny-llama", student_copy) == [
        "chat template: the two render conversations differently",
        "the teacher's embedding has 500 rows, fewer than the student's 512 tokens",
    ]


def test_a_run_refuses_a_teacher_of_another_tokenizer_naming_both(student_copy):
    other_eos(student_copy)
    config = load_config([f"teacher.model.path={student_copy}"])
    plan = make_run_plan(config).with_models()
    with pytest.raises(ConfigError) as error:
        check_teacher_tokenizer(config, plan)
    message = str(error.value)
    assert "teacher.model.path" in message and f"the teacher {student_copy}" in message
    assert "student tiny-llama" in message and "eos_token" in message and "hybridflow distill-data" in message


def test_a_lora_adapter_directory_is_refused_with_the_export_that_merges_it(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="(?s)holds LoRA adapters.*--merged"):
        make_run_plan(load_config([f"teacher.model.path={tmp_path}"]))
