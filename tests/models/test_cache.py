"""The cache: build once, atomically; a failed build leaves nothing; a stale entry is replaced."""

import threading
import time
from pathlib import Path

import pytest

from hybridflow.models import cache_root
from hybridflow.models.cache import FINGERPRINT_FILE, materialise, model_cache_dir


def writer(calls: list, text: str, delay: float = 0.0):
    def build(out):
        calls.append(out)
        time.sleep(delay)
        (out / "config.json").write_text(text)

    return build


def test_cache_root_follows_the_environment(model_cache, monkeypatch, tmp_path):
    assert cache_root() == model_cache
    assert model_cache_dir("x") == model_cache / "models" / "x"
    monkeypatch.delenv("HYBRIDFLOW_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the user's cache directory
    assert cache_root() == tmp_path / "hybridflow"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "hybridflow"


def test_a_build_says_what_it_does_and_no_library_draws_a_bar(capsys):
    """transformers' bars are on here (as in a user's own script): the build keeps them off while it runs and
    prints its own line, then leaves them as they were."""
    from transformers.utils import logging as transformers_logging

    from hybridflow.models import resolve_model_path

    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    try:
        capsys.readouterr()
        materialise(model_cache_dir("announced"), {"v": 1}, writer([], "a"), announce="building the test model")
        resolve_model_path("tiny-llama", hidden_size=16)  # a real build: transformers saves a model
        out, err = capsys.readouterr()
        assert out == f"hybridflow: building the test model into {model_cache_dir('announced')}\n"
        assert err == ""  # no "Writing model shards: 100%|..."
        assert transformers_logging.is_progress_bar_enabled()
    finally:
        if not was_on:
            transformers_logging.disable_progress_bar()


def test_builds_once():
    calls = []
    target = model_cache_dir("once")
    assert materialise(target, {"v": 1}, writer(calls, "a")) == target
    assert materialise(target, {"v": 1}, writer(calls, "b")) == target
    assert len(calls) == 1 and (target / "config.json").read_text() == "a"
    assert (target / FINGERPRINT_FILE).is_file()


def test_failed_build_leaves_nothing():
    target = model_cache_dir("crash")

    def crash(out):
        (out / "half.safetensors").write_text("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        materialise(target, {"v": 1}, crash)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".crash.tmp")] == []
    calls = []
    materialise(target, {"v": 1}, writer(calls, "ok"))
    assert (target / "config.json").read_text() == "ok"


def test_stale_entry_is_rebuilt():
    target = model_cache_dir("stale")
    materialise(target, {"v": 1}, writer([], "old"))
    materialise(target, {"v": 2}, writer([], "new"))
    assert (target / "config.json").read_text() == "new"
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".stale.")] == [".stale.lock"]


def test_concurrent_builders_build_once():
    calls, results = [], []
    target = model_cache_dir("race")
    threads = [
        threading.Thread(target=lambda: results.append(materialise(target, {"v": 1}, writer(calls, "x", 0.2))))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 3 and len(calls) == 1


def test_a_build_that_writes_no_model_is_refused_and_leaves_nothing():
    target = model_cache_dir("empty")

    def tokenizer_only(out):
        (out / "tokenizer.json").write_text("{}")

    with pytest.raises(RuntimeError, match=r"wrote no config.json \(only \['tokenizer.json'\]\)"):
        materialise(target, {"v": 1}, tokenizer_only)
    assert not target.exists()


def _rank_builds(rank: int, cache: str, init_file: str, results) -> None:
    import os

    import torch
    import torch.distributed as dist

    os.environ["HYBRIDFLOW_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from hybridflow.models import load_causal_lm, resolve_model_path

    if rank == 1:  # the first to ask: transformers' save_pretrained would write nothing on this rank
        path = resolve_model_path("tiny-llama")
        results.put(sorted(p.name for p in path.iterdir()))
        results.put(sum(p.numel() for p in load_causal_lm(str(path), dtype=torch.float32).parameters()))
    dist.barrier()
    dist.destroy_process_group()


def test_a_distributed_rank_other_than_0_builds_a_whole_model(tmp_path):
    """transformers writes a model's files only on distributed rank 0: a worker of rank 1 that is first to ask for a
    built-in model must still build all of it (in a child process), not a directory with a tokenizer alone."""
    import torch.multiprocessing as mp

    from hybridflow.models import load_causal_lm

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_builds, args=(str(tmp_path / "cache"), str(tmp_path / "init"), results), nprocs=2)
    files, parameters = results.get(), results.get()
    assert "config.json" in files and "model.safetensors" in files
    assert parameters == sum(p.numel() for p in load_causal_lm("tiny-llama").parameters())
