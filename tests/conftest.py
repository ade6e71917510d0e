"""The suite's own caches and the order of its files, and fixtures shared by the engine and hybrid-engine tests: the
tiny model, an fp32 actor config, a rollout batch. The two tiers (``slow`` and the rest) are tests/tiers.py's, the
rule that places a test in one tests/README.md's."""

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import ray
import torch
from cache_helpers import SUITE_CACHES, TEST_CACHES_ENV
from tiers import Tiers
from xdist.scheduler import LoadFileScheduling

from hybridflow.batch_keys import ADVANTAGES, ATTENTION_MASK, GLOBAL_STEP, INPUT_IDS, POSITION_IDS, RESPONSE_MASK
from hybridflow.controller import (
    RoleSpec,
    keep_worker_processes,
    kept_process_counts,
    start_ray,
    stop_keeping_worker_processes,
)
from hybridflow.controller.ray_runtime import tuning_env
from hybridflow.data.tasks import write_task
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm, load_reward_model, load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.hf import HFRollout
from hybridflow.trainer.setup.config import load_config
from hybridflow.workers import ActorRolloutWorker

KEPT_WORKER_PROCESSES = 8  # per test process: a few hundred MB each with the tiny models


@pytest.hookimpl(trylast=True)  # after pytest's own: the base temp directory is set
def pytest_configure(config):
    config.pluginmanager.register(Tiers(), "tiers")  # the two tiers' marks and checks (tests/tiers.py)
    suite_caches(config)


def suite_caches(config):
    """The suite builds every cache it uses itself, in a directory of its own run (under pytest's base temp
    directory, which keeps the last three runs', or the empty one $HYBRIDFLOW_TEST_CACHES names): a run passes or
    fails on a fresh machine as on one where earlier runs left converted models, compiled kernels or Ray's files
    behind (tests/test_fresh_caches.py). The test processes of pytest-xdist inherit this environment from the
    process that starts them, so each cache is built once per run, by whichever process needs it first (the
    builders lock: models/cache.py, torch's extension builder)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a test process: the controller set the environment
        return
    shared = os.environ.get(TEST_CACHES_ENV)
    suite = Path(shared) if shared else config._tmp_path_factory.getbasetemp() / "suite"
    for variable, name in SUITE_CACHES.items():
        (suite / name).mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(suite / name)
    os.environ["RAY_TMPDIR"] = str(suite)  # Ray's session files under suite/ray (its socket paths stay short)


@pytest.fixture(scope="module", autouse=True)
def _the_session_s_environment():
    """Each test module leaves the environment as it found it. Code a module runs in this process may set variables
    that outlive it: vLLM started in-process sets a score (shared-memory buffer names, its local world size and log
    level, the address of a tensor torch's compiler hands its kernels), and a Ray cluster or a command this process
    starts later inherits them (vLLM's workers in test_vllm_e2e.py logged at another engine's level after
    tests/rollout/vllm/ had run in the same test process)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def empty_model_cache(tmp_path, monkeypatch) -> Path:
    """An empty model cache for this test (``HYBRIDFLOW_CACHE``), as on a fresh machine: a test that must build no
    model checks that ``cache_helpers.built_models`` of it stays empty."""
    cache = tmp_path / "empty-model-cache"
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return str(resolve_model_path("tiny-llama"))


def fp32_actor_config(path: str, lr: float, *extra: str):
    """An actor config in fp32 whose AdamW step is linear in the gradient (eps=1), so results compare exactly."""
    return load_config(
        [
            f"actor_rollout_ref.model.path={path}",
            "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=6",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.shuffle=false",
            f"actor_rollout_ref.actor.optim.lr={lr}",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "actor_rollout_ref.actor.optim.eps=1.0",
            "actor_rollout_ref.actor.grad_clip=1000.0",
            *extra,
        ]
    ).actor_rollout_ref


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory):
    """tiny-llama as a reward model with a random scoring head (the loader zeroes a head the checkpoint
    lacks, which would score every conversation 0): one that tells conversations apart."""
    directory = tmp_path_factory.mktemp("rm")
    torch.manual_seed(1)
    model = load_reward_model("tiny-llama")
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(directory)
    load_tokenizer("tiny-llama").save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def actor_config_factory():
    return fp32_actor_config


def actor_worker(config, world_size: int, total_training_steps: int = 10) -> RoleSpec:
    """The actor worker as the trainer builds it from a run plan, all ``world_size`` ranks data-parallel."""
    kwargs = dict(
        config=config,
        model_path=config.model.path,
        layout=LayoutShape(dp=world_size, t=1, tg=1),
        tool_config="",
        default_agent=config.rollout.multi_turn.default_agent,
        mini_batch_per_rank=config.actor.ppo_mini_batch_size * config.rollout.n // world_size,
        total_training_steps=total_training_steps,
        seed=0,
    )
    return RoleSpec(ActorRolloutWorker, kwargs=kwargs)


@pytest.fixture(scope="session")
def actor_worker_factory():
    return actor_worker


@pytest.fixture(scope="session")
def rollout_batch(tiny_path) -> DataProto:
    """Six prompt+response rows of different lengths, from greedy generation of the initial tiny model."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(tiny_path)
    questions = ["1 + 1", "What is 12 times 3?", "hello", "Tell me 5 - 2", "9", "Add 7 and 8 and 100 please"]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompts = DataProto.from_dict(
        {
            INPUT_IDS: encoded["input_ids"],
            ATTENTION_MASK: encoded["attention_mask"],
            POSITION_IDS: (encoded["attention_mask"].cumsum(1) - 1).clamp(min=0),
        }
    )
    rollout = HFRollout(load_causal_lm(tiny_path, dtype=torch.float32), tokenizer)
    batch = rollout.generate_sequences(prompts, SamplingParams.greedy(max_new_tokens=5, seed=0))
    batch.batch[RESPONSE_MASK][1, 3:] = 0  # responses of unequal lengths
    batch.batch[RESPONSE_MASK][4, 1:] = 0
    mask = batch.batch[RESPONSE_MASK].float()
    batch.batch[ADVANTAGES] = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape) * mask
    batch.meta_info[GLOBAL_STEP] = 1  # the driver's step, which workers derive seeds from
    return batch


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray cluster for the worker groups and whole runs of every module that asks for it: started by the
    first (or by the first after a test that needed none running, see no_ray) and shut down at the end of the
    session. A run (``hybridflow.trainer.commands.train.run``, ``commands.sft.run``) finds Ray started and places
    its workers on it, releasing them when it ends, instead of starting and stopping a cluster of its own: seconds
    of CPU each on a small machine. Its workers get the environment a run's own cluster gives them (a run's pools
    add its tuning settings). The session keeps finished runs' worker processes for the next runs of the same shape
    (``keep_worker_processes``): a new one costs seconds of imports, more than most of these runs. The cluster
    gives every worker the default run's tuning settings, so that the pools tests build directly and the runs'
    pools (which ask for those settings) share kept processes. Commands that tests start join it too
    (``trainer.ray_address``). Its logical CPUs (what Ray may place, not threads) leave room for a command's
    workers beside every kept process: kept ones give way only to this process's pools."""
    default_run = load_config([]).trainer
    start_ray(num_cpus=2 * KEPT_WORKER_PROCESSES, worker_env=tuning_env(default_run.cpu_kernel_cache_capacity))
    keep_worker_processes(KEPT_WORKER_PROCESSES)
    yield


@pytest.fixture
def keeping():
    """Start the test with no worker process kept; afterwards the session's keeping again (what the test kept is
    ended). Yields ``keep_worker_processes``."""
    stop_keeping_worker_processes()
    yield keep_worker_processes
    stop_keeping_worker_processes()
    keep_worker_processes(KEPT_WORKER_PROCESSES)


@pytest.fixture(scope="session", autouse=True)
def _no_ray_after_the_session():
    yield
    if counts_file := os.environ.get("HYBRIDFLOW_KEPT_COUNTS_FILE"):  # how often the session reused processes
        with open(counts_file, "a") as out:
            out.write(json.dumps(kept_process_counts()) + "\n")
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def no_ray():
    """No Ray cluster running when the test starts (the shared one is shut down; the next module that asks for
    local_ray starts it again): for a test whose run must start and end a cluster of its own, or that checks
    that nothing started Ray. Give it to the tests of a module that come after those that use local_ray."""
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def arithmetic_files(tmp_path_factory):
    """The built-in arithmetic task's train and test parquet files (64 and 8 prompts)."""
    out = tmp_path_factory.mktemp("arithmetic")
    write_task("arithmetic", out, train=64, test=8, seed=0)
    return out / "train.parquet", out / "test.parquet"


# The order of the files, for every tier (`make test`, `make test-slow`: their test processes take whole files in
# this order) and for one process. First the files whose tests need no shared Ray cluster running (no_ray: they check
# that nothing started Ray, or start and end a cluster of their own): run before any file of their test process has
# started the shared one, they shut nothing down, so that cluster starts once per test process and the worker
# processes it keeps serve every later file. Then the files that take longest in each tier (the kept-processes tests
# end what their test process kept, so they are best before it has kept much), so that the test processes finish
# together instead of one running these alone at the end while the other idles. Then the files that start a vLLM
# engine (10-20 s for one to five tests: in xdist's order they came last, and one test process ran them alone for
# 20 s). Then the rest, the files with the most tests first (xdist's own order).
LONGEST_FILES = (
    # the slow tier's
    "tests/trainer/test_kill_and_resume.py",
    "tests/trainer/test_verifiers_e2e.py",
    "tests/serve/test_trainer_equality.py",
    "tests/rollout/agent_server/test_verifiers_environments.py",
    "tests/serve/test_restart.py",
    "tests/trainer/test_placement_e2e.py",
    "tests/trainer/test_multi_turn_e2e.py",
    "tests/trainer/test_fully_async_resume.py",
    # the fast tier's
    "tests/controller/test_kept_processes.py",
    "tests/hybrid_engine/test_pool_transfer.py",
    "tests/controller/test_ray_worker_group.py",
    "tests/models/test_smollm2.py",
)
VLLM_FILES = ("tests/rollout/vllm/", "tests/trainer/test_vllm_e2e.py")
# The serve modules that share one `hybridflow serve` (tests/serve/conftest.py; 10 s to start alone, 25-32 s in a
# loaded run): one unit of work for pytest-xdist, so that a single test process runs them and starts it once.
ONE_SERVICE_FILES = (
    "tests/serve/test_conformance.py",
    "tests/serve/test_bad_clients.py",
    "tests/serve/test_trainer_equality.py",
)


class FilesAndOneService(LoadFileScheduling):
    """pytest-xdist's --dist loadfile, with the files of ONE_SERVICE_FILES as one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        file = super()._split_scope(nodeid)
        return "tests/serve (one service)" if file in ONE_SERVICE_FILES else file


def pytest_xdist_make_scheduler(config, log):
    return FilesAndOneService(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_collection_modifyitems(items):
    files = [item.nodeid.split("::", 1)[0] for item in items]
    tests_in = Counter(files)
    own_ray = {file for file, item in zip(files, items) if "no_ray" in item.fixturenames}
    shared_ray = {file for file, item in zip(files, items) if "local_ray" in item.fixturenames}
    if mixed := sorted(own_ray & shared_ray):
        raise pytest.UsageError(f"{mixed}: a file's tests use either local_ray or no_ray, not both (split the file)")
    first = {file: rank for rank, file in enumerate(LONGEST_FILES)}

    def place(i: int) -> tuple:
        file = files[i]
        group = 0 if file in own_ray else 1 if file in first else 2 if file.startswith(VLLM_FILES) else 3
        return group, first.get(file, 0), -tests_in[file], file, i

    items[:] = [items[i] for i in sorted(range(len(items)), key=place)]
