"""tinker:// paths and their directories: the grammar, owners, and atomic saves that leave nothing behind."""

import json

import pytest

from hybridflow.serve.storage import PathError, Storage, check_name, owner_of, parse_path

MODEL_ID = "0123abcd:train:0"


def test_paths_parse_and_refuse_what_could_escape():
    saved = parse_path(f"tinker://{MODEL_ID}/weights/step-10")
    assert (saved.model_id, saved.kind, saved.name) == (MODEL_ID, "weights", "step-10")
    for bad in ("file:///etc", f"tinker://{MODEL_ID}/weights/../x", f"tinker://{MODEL_ID}/other/x", "tinker://a/b/c/d"):
        with pytest.raises(PathError) as error:
            parse_path(bad)
        assert error.value.status == 400
    with pytest.raises(PathError, match="checkpoint name"):
        check_name("../escape")


def test_a_save_is_whole_or_absent_and_only_its_owner_reads_it(tmp_path):
    storage = Storage(tmp_path)
    saved = parse_path(f"tinker://{MODEL_ID}/weights/a")
    mine, theirs = owner_of("tml-mine-key-000000"), owner_of("tml-their-key-00000")

    def broken(directory):
        (directory / "adapter_model.safetensors").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        storage.save(saved, mine, {"rank": 2}, broken)
    assert not storage.directory(saved).exists() and not any((tmp_path / ".scratch").iterdir())
    storage.save(saved, mine, {"rank": 2}, lambda d: (d / "adapter_model.safetensors").write_text("whole"))
    _, directory, meta = storage.read(saved.uri, mine)
    assert meta["rank"] == 2 and (directory / "adapter_model.safetensors").read_text() == "whole"
    assert "tml-" not in json.dumps(meta)  # the key itself is never written
    with pytest.raises(PathError) as error:
        storage.read(saved.uri, theirs)
    assert error.value.status == 404
    with pytest.raises(PathError, match="exists"):
        storage.save(saved, mine, {"rank": 3}, lambda d: None)
    storage.save(saved, mine, {"rank": 3}, lambda d: None, overwrite=True)
    assert storage.read(saved.uri, mine)[2]["rank"] == 3
