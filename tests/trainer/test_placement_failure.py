"""A pool that fails stops the whole run, naming its role, rank and remote traceback, and the run's own Ray cluster
leaves no worker process behind (the run starts and ends its cluster: no shared one may be running)."""

import subprocess
import time
import uuid
from pathlib import Path

import pytest
from test_placement_e2e import ppo_run

from hybridflow.controller import WorkerError
from hybridflow.models import resolve_model_path

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_ray")]


def broken_reward_model(tmp_path):
    """A reward model whose vocabulary is smaller than its tokenizer's: it loads, then fails on real text."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    source = resolve_model_path("tiny-llama")
    config = AutoConfig.from_pretrained(source)
    config.vocab_size, config.num_labels = 8, 1
    directory = tmp_path / "broken-rm"
    LlamaForSequenceClassification(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory


def worker_processes(tag: str) -> set[int]:
    """This test's Ray worker processes: those whose environment carries ``tag`` (Ray's processes inherit the
    driver's environment), so another run on the machine is not counted, and orphans still are."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            name = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):  # gone meanwhile, or not a process
            continue
        if f"{TAG_VARIABLE}={tag}".encode() in environ and name.startswith(b"ray::"):
            found.add(int(proc.name))
    return found


def worker_processes_left(tag: str, within_s: float = 20.0) -> set[int]:
    """The test's Ray worker processes still there ``within_s`` after a run ended (empty as soon as none is): the
    run's end stops Ray, and its workers exit on their own a moment later, seconds on a loaded machine; an orphan
    never does."""
    deadline = time.monotonic() + within_s
    while (left := worker_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


TAG_VARIABLE = "HYBRIDFLOW_TEST_RUN"


def test_a_failing_pool_stops_the_run_with_its_role_rank_and_traceback(arithmetic_files, tmp_path, monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)
    stand_in = subprocess.Popen(["bash", "-c", "exec -a ray::WorkerHost sleep 60"])  # the count sees a tagged one
    try:
        deadline = time.monotonic() + 10
        while worker_processes(tag) != {stand_in.pid} and time.monotonic() < deadline:
            time.sleep(0.05)  # until bash has exec'd under the new name
        assert worker_processes(tag) == {stand_in.pid}
    finally:
        stand_in.kill()
        stand_in.wait()
    with pytest.raises(WorkerError) as raised:
        ppo_run(
            arithmetic_files,
            tmp_path / "run",
            "trainer.placement=group_colocate",
            "trainer.n_workers_per_node=1",
            f"reward_model.model.path={broken_reward_model(tmp_path)}",
        )
    error = raised.value
    assert error.group == "reward_model" and error.method == "compute_rm_score" and error.rank == 0
    assert "IndexError" in error.remote_traceback and "compute_rm_score" in error.remote_traceback
    assert worker_processes_left(tag) == set()  # every pool's processes are gone
