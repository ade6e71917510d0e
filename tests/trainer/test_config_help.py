"""Each key's help is written once, as the comment on its dataclass field; the YAML's comments are made from it."""

import dataclasses
import typing

import yaml

from hybridflow.cli import main
from hybridflow.trainer.setup.config import DEFAULT_CONFIG, HybridFlowConfig
from hybridflow.trainer.setup.config_help import Help, key_help, yaml_with_help


def leaf_keys(cls=HybridFlowConfig, prefix=""):
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from leaf_keys(hints[field.name], f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}"


def test_every_key_has_help():
    helps = key_help()
    missing = [key for key in leaf_keys() if not helps.get(key)]
    assert not missing, f"fields without a help comment: {missing}"


def test_the_default_yaml_comments_are_the_dataclass_help():
    text = DEFAULT_CONFIG.read_text()
    assert yaml_with_help(text, key_help()) == text, "run: python -m hybridflow.config_yamls"


def test_comments_are_rewritten_and_values_kept():
    text = "# header\na:\n  b: 1  # old words\n  # a stale note\n  c: 'x # y'\nd: [1, 2]\n"
    helps = {"a": None, "a.b": Help("new words", above=False), "a.c": Help("a long " * 30, above=False)}
    out = yaml_with_help(text, helps)
    assert yaml.safe_load(out) == yaml.safe_load(text)
    lines = out.splitlines()
    assert lines[0] == "# header" and lines[2] == "  b: 1  # new words"
    assert "stale" not in out and lines[-1] == "d: [1, 2]"  # a key without help keeps no comment
    assert lines[3].startswith("  # a long") and lines[-2] == "  c: 'x # y'"  # too long: above, wrapped
    assert all(len(line) <= 120 for line in lines)


def test_train_help_lists_a_sections_keys_with_defaults_and_help(capsys):
    assert main(["train", "--help", "algorithm.kl_ctrl"]) == 0
    out = capsys.readouterr().out
    assert "algorithm.kl_ctrl.type = 'fixed'\n    a registered controller" in out
    assert "algorithm.kl_ctrl.horizon = 10000" in out and "algorithm.gamma" not in out


def test_train_help_names_an_unknown_section(capsys):
    assert main(["train", "--help", "algorithm.nope"]) == 2
    assert "config key 'algorithm.nope': no such key or section" in capsys.readouterr().err
