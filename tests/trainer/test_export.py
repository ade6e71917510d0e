"""``hybridflow export``: a checkpoint is verified before it is read; a damaged one, or a directory that only
looks like one, is one message naming it (exit code 2) and nothing is written; a run directory exports its
newest intact checkpoint and says which, and which damaged ones it skipped.

The checkpoints hold the tiny built-in Llama's state, written in this process as a worker writes it
(engine/checkpoint.py, and the Hugging Face files beside it): about 2 MB, well under a second."""

import errno
import os
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.cli import main as cli
from hybridflow.engine.checkpoint import save_training_state
from hybridflow.engine.optim import TrainedModel
from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.trainer.services.checkpoint import CheckpointManager
from hybridflow.trainer.services.checkpoint_check import MANIFEST

SHARD = "actor/dcp/__0_0.distcp"


@pytest.fixture(scope="module")
def tiny():
    """The tiny model, its tokenizer, and its weights as loaded."""
    path = resolve_model_path("tiny-llama")
    model = load_causal_lm(str(path))
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return model, load_tokenizer(str(path)), weights


@pytest.fixture
def save(tiny):
    """``save(run_dir, step)``: a checkpoint of the tiny model with its weights times ``step`` (each
    checkpoint told apart by its weights)."""
    model, tokenizer, weights = tiny

    def write_roles(directory: Path, step: int) -> None:
        model.load_state_dict({name: tensor * step for name, tensor in weights.items()})
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
            save_training_state(directory / "actor", TrainedModel(model, optimizer, scheduler), rank=0)
        for part in (model.config, model.generation_config, tokenizer):
            part.save_pretrained(directory / "actor" / "huggingface")

    def save(run_dir: Path, step: int) -> Path:
        state = {"global_step": step, "data_loader": {}, "kl_coef": 0.0}
        return CheckpointManager(run_dir).save(step, lambda directory: write_roles(directory, step), state)

    return save


def export(source: Path, out: Path, capsys) -> tuple[int, str, str]:
    code = cli(["export", str(source), str(out)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_message(code: int, err: str, *expected: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridflow: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]


def test_a_run_directory_exports_its_newest_intact_checkpoint_and_says_so(tmp_path, save, tiny, capsys):
    run = tmp_path / "run"
    good = save(run, 1)
    bad = save(run, 2)
    os.truncate(bad / SHARD, 3)
    with pytest.warns(UserWarning) as caught:
        code, out, err = export(run, tmp_path / "hf", capsys)
    assert code == 0, err
    notes = [str(w.message) for w in caught]
    assert len(notes) == 1 and "skipping damaged checkpoint(s)" in notes[0]
    assert f"{bad} ({SHARD} has 3 bytes" in notes[0] and notes[0].endswith("; exporting from global_step_1")
    assert out.splitlines() == [f"exporting from {good}", f"exported to {tmp_path / 'hf'}"]
    assert "resuming" not in out + err + notes[0]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, tensor in tiny[2].items():  # step 1's weights: the originals, times 1
        assert torch.equal(exported[name], tensor), name


def test_a_checkpoint_without_a_manifest_exports_with_a_warning(tmp_path, save, capsys):
    checkpoint = save(tmp_path / "run", 1)
    (checkpoint / MANIFEST).unlink()
    with pytest.warns(UserWarning, match=f"{checkpoint} has no MANIFEST.json"):
        code, out, err = export(checkpoint, tmp_path / "hf", capsys)
    assert code == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), err


def unreadable_shard(monkeypatch, checkpoint: Path) -> None:
    """Opening the shard fails as for a user without read permission (chmod 000; these tests run as root,
    which ignores file modes)."""
    real_open, shard = Path.open, checkpoint / SHARD

    def fails(self, *args, **kwargs):
        if self == shard:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", fails)


def overwrite_same_size(path: Path) -> None:
    path.write_bytes(b"\x07" * path.stat().st_size)


# damage to a checkpoint named directly -> the problem the message names
DAMAGE = {
    "a truncated shard": (lambda c, mp: os.truncate(c / SHARD, 3), f"{SHARD} has 3 bytes, "),
    "a truncated shard, no manifest": (
        lambda c, mp: ((c / MANIFEST).unlink(), os.truncate(c / SHARD, 3)),
        f"{SHARD} has 3 bytes, and its DCP metadata places",
    ),
    "an overwritten shard": (lambda c, mp: overwrite_same_size(c / SHARD), f"{SHARD} changed since it was written"),
    "an unreadable shard": (lambda c, mp: unreadable_shard(mp, c), f"{SHARD} cannot be read (Permission denied)"),
    "no DCP metadata": (lambda c, mp: (c / "actor/dcp/.metadata").unlink(), "actor/dcp/.metadata is missing"),
    "no Hugging Face config": (
        lambda c, mp: ((c / MANIFEST).unlink(), (c / "actor/huggingface/config.json").unlink()),
        "actor/huggingface/config.json is missing",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_one_message(tmp_path, save, monkeypatch, capsys, damage):
    checkpoint = save(tmp_path / "run", 1)
    damage_it, problem = DAMAGE[damage]
    damage_it(checkpoint, monkeypatch)
    code, out, err = export(checkpoint, tmp_path / "hf", capsys)
    one_message(code, err, f"cannot export {checkpoint}: ", problem)
    assert not (tmp_path / "hf").exists() and not out


def test_shards_that_look_whole_but_do_not_load_are_one_message(tmp_path, save, capsys):
    """Without a manifest, bytes that changed are found only by loading them: still one message."""
    checkpoint = save(tmp_path / "run", 1)
    (checkpoint / MANIFEST).unlink()
    overwrite_same_size(checkpoint / SHARD)
    with pytest.warns(UserWarning, match="has no MANIFEST.json"):
        code, out, err = export(checkpoint, tmp_path / "hf", capsys)
    one_message(code, err, f"cannot export {checkpoint}: its actor does not load, damaged or not hybridflow's (")
    assert not (tmp_path / "hf").exists()


def test_a_directory_that_only_looks_like_a_checkpoint_is_one_message(tmp_path, capsys):
    junk = tmp_path / "my_model"
    (junk / "actor").mkdir(parents=True)
    (junk / "actor" / "pytorch_model.bin").write_bytes(b"junk")
    code, _, err = export(junk, tmp_path / "hf", capsys)
    one_message(code, err, f"cannot export {junk}: actor/dcp/.metadata is missing")
    assert not (tmp_path / "hf").exists()


def test_a_run_directory_with_only_damaged_checkpoints_is_one_message(tmp_path, save, capsys):
    run = tmp_path / "run"
    only = save(run, 1)
    os.truncate(only / SHARD, 3)
    (run / "global_step_2").mkdir()
    code, _, err = export(run, tmp_path / "hf", capsys)
    one_message(
        code,
        err,
        f"nothing to export from {run}: every checkpoint in it is damaged",
        "not tried: global_step_2, after the step",
    )
    assert f"{only} ({SHARD} has 3 bytes" in err


@pytest.mark.parametrize("what", ["nothing there", "an empty directory"])
def test_neither_a_checkpoint_nor_a_run_directory_is_one_message(tmp_path, capsys, what):
    source = tmp_path / "source"
    if what == "an empty directory":
        source.mkdir()
    code, _, err = export(source, tmp_path / "hf", capsys)
    one_message(code, err, f"{source} is neither a checkpoint", "nor a run directory")


def test_an_output_path_that_is_a_file_is_one_message(tmp_path, save, capsys):
    checkpoint = save(tmp_path / "run", 1)
    (tmp_path / "hf").write_text("not a directory")
    code, _, err = export(checkpoint, tmp_path / "hf", capsys)
    one_message(code, err, f"cannot export to {tmp_path / 'hf'}: it is a file")
