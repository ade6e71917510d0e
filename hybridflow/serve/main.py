"""``hybridflow serve [--config FILE] key=value ...``: the Tinker API on this machine's workers.

Checks the config and the keys, builds the base model (a built-in name is converted once into the cache), starts
Ray and the worker (workers/adapter_service.py), then serves until interrupted; the worker and Ray stop with it.
Point the tinker SDK at it with ``TINKER_BASE_URL=http://<host>:<port>`` and ``TINKER_API_KEY=<a key>``
(docs/serve.md). Also runnable as ``python -m hybridflow.serve.main``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import sys
from pathlib import Path

import uvicorn
from transformers import AutoConfig

from hybridflow.controller import RayResourcePool, RayWorkerGroup, RoleSpec
from hybridflow.controller.ray_runtime import tuning_env
from hybridflow.serve.app import build_app
from hybridflow.serve.config import SERVE_DEFAULT_CONFIG, ServeConfig, load_serve_config
from hybridflow.serve.service import ServedModel, TrainingService
from hybridflow.serve.storage import owner_of
from hybridflow.trainer.setup.cluster import check_local_cluster, ray_for_run
from hybridflow.trainer.setup.config import ConfigError, default_config
from hybridflow.trainer.setup.config_help import config_command_args, run_as_module
from hybridflow.trainer.setup.placement import Placement
from hybridflow.trainer.setup.run_plan import model_dir_or_name, resolve_model_dir
from hybridflow.validation import reading_file
from hybridflow.workers.adapter_service import AdapterServiceWorker

KEYS_ENV = "HYBRIDFLOW_SERVE_API_KEYS"
KEY_PREFIX = "tml-"  # the SDK refuses a key without it
POOL = "serve"
LOST_WORKER_GRACE_S = 10.0  # a lost worker: how long the service answers (that it stops) before it stops


def api_keys(config: ServeConfig) -> dict[str, str]:
    """Owner name -> key, from the key file and $HYBRIDFLOW_SERVE_API_KEYS; with neither, a new key, printed and
    written to <storage_dir>/api_key (readable by this user only)."""
    keys = [k.strip() for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip()]
    path = config.service.api_key_file
    if path:
        with reading_file(path, key="service.api_key_file"):
            keys += [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    for key in keys:
        if not key.startswith(KEY_PREFIX) or len(key) < 16:
            where = f"file '{path}'" if path else KEYS_ENV
            raise ConfigError(
                "service.api_key_file",
                f"a key in {where} is not 'tml-' followed by at least 12 characters (the SDK's rule)",
                "e.g. tml-" + secrets.token_hex(16),
            )
    if not keys:
        key = KEY_PREFIX + secrets.token_hex(24)
        storage = Path(config.service.storage_dir)
        storage.mkdir(parents=True, exist_ok=True)
        key_file = storage / "api_key"
        key_file.write_text(key + "\n")
        key_file.chmod(0o600)
        print(f"hybridflow serve: no API key given; made one, written to {key_file}")
        keys = [key]
    return {owner_of(key): key for key in keys}


def served_model(config: ServeConfig, directory: str, described: dict) -> ServedModel:
    hf = AutoConfig.from_pretrained(directory, local_files_only=True)
    return ServedModel(
        name=config.model.served_name,
        directory=directory,
        arch=hf.model_type,
        vocab_size=int(described["vocab_size"]),
        max_context=int(getattr(hf, "max_position_embeddings", 0) or config.limits.max_tokens_per_datum),
        parts=frozenset(described["parts"]),
    )


class WorkerBackend:
    """The service's calls on the worker group (one rank: its answer)."""

    def __init__(self, group: RayWorkerGroup):
        self.group = group

    def __getattr__(self, name: str):
        method = getattr(self.group, name)
        return lambda *args, **kwargs: method(*args, **kwargs)[0]


def serve(config: ServeConfig) -> None:
    model_dir_or_name(config.model.path, "model.path")  # a ConfigError before anything starts
    placement = Placement({POOL: [1]}, {})
    if not config.worker.ray_address:
        check_local_cluster(config.worker, placement, section="worker")
    keys = api_keys(config)
    directory = resolve_model_dir(config.model.path, "model.path")
    rollout = dataclasses.replace(default_config().actor_rollout_ref.rollout, name="native", dtype=config.sampler.dtype)
    worker = config.worker
    with ray_for_run(worker, placement, section="worker"):
        pool = RayResourcePool(
            [1],
            use_gpu=worker.device == "cuda",
            cpus_per_worker=worker.cpus_per_worker,
            threads_per_worker=worker.threads_per_worker or None,
            ready_timeout_s=worker.placement_timeout_s,
            name=POOL,
            worker_env=tuning_env(64),
        )
        try:
            spec = RoleSpec(
                AdapterServiceWorker,
                kwargs=dict(
                    model_path=directory,
                    max_lora_rank=config.model.max_lora_rank,
                    fsdp=config.model.fsdp,
                    rollout=rollout,
                    max_tokens_per_micro_batch=config.model.max_tokens_per_micro_batch,
                    seed=worker.seed,
                ),
            )
            group = RayWorkerGroup(pool, spec, name=POOL)
            backend = WorkerBackend(group)
            served = served_model(config, directory, backend.describe())
            service = TrainingService(config, backend, served, keys)
            app = build_app(service, keys)
            server = uvicorn.Server(
                uvicorn.Config(app, host=config.service.host, port=config.service.port, log_level="warning")
            )

            def stop_soon(reason: str) -> None:  # first the clients waiting on a result fetch its failure
                asyncio.get_running_loop().call_later(LOST_WORKER_GRACE_S, setattr, server, "should_exit", True)

            service.on_worker_lost = stop_soon
            print(
                f"hybridflow serve: {served.name} (LoRA up to rank {config.model.max_lora_rank}) at "
                f"http://{config.service.host}:{config.service.port}; storage {service.storage.root}",
                flush=True,
            )
            server.run()
            if service.worker_lost is not None:
                raise SystemExit(f"hybridflow serve: stopped: {service.worker_lost}")
        finally:
            pool.release(keep_processes=False)


ABOUT = f"""A training service with the Tinker API: LoRA training clients on one base model, sampling clients, saved
weights under tinker:// paths (docs/serve.md). Every key has its default in {SERVE_DEFAULT_CONFIG}:
  hybridflow serve model.path=smollm2-135m-instruct service.port=8000
Then, in the client's shell: TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=<key> python my_loop.py
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = config_command_args(args, "serve", ABOUT, ServeConfig, SERVE_DEFAULT_CONFIG)
    if parsed is not None:
        try:
            serve(load_serve_config(*parsed))
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":  # python -m hybridflow.serve.main: the same command as hybridflow serve
    sys.exit(run_as_module(main))
