"""The training service's state, shared by its parts (sessions.py, training.py, weights.py, sampling.py): the records
of sessions, training models and samplers, the worker's calls, the futures, and the lookups that enforce ownership.

Everything runs on the server's event loop, one call at a time, so the state needs no locks. Work for the worker goes
to one executor thread, in the order it is submitted. A request is answered at once with a future; its result (or
its error, with the category the SDK reports) is fetched by ``retrieve``. Models, samplers and results are each owned
by one session (saved paths by one API key): a lookup by another key finds nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hybridflow.algorithms.datum_losses import Datum
from hybridflow.serve.config import LimitsConfig, ServeConfig
from hybridflow.serve.futures import USER, Executor, Job, Outcome, Results, ServiceError
from hybridflow.serve.storage import SavedPath, Storage
from hybridflow.workers.adapter_service import AdapterSpec, SampleSpec

log = logging.getLogger("hybridflow.serve")


class Backend(Protocol):
    """The worker's calls (workers/adapter_service.py), one at a time, on the executor thread."""

    def describe(self) -> dict: ...
    def create_adapter(self, key: str, spec: AdapterSpec, seed: int) -> None: ...
    def drop_adapter(self, key: str) -> None: ...
    def forward_backward(self, key: str, datums: list[Datum], loss: str, config: dict, forward_only: bool) -> Any: ...
    def optim_step(self, key: str, **settings: Any) -> dict[str, float]: ...
    def save_adapter(self, key: str, directory: str, with_optimizer: bool) -> None: ...
    def load_adapter(self, key: str, directory: str, spec: AdapterSpec, with_optimizer: bool) -> None: ...
    def forget_sampler(self, sampler: str) -> None: ...
    def sample(self, sampler: str, directory: str | None, spec: AdapterSpec | None, request: SampleSpec) -> Any: ...


@dataclass
class Session:
    id: str
    owner: str
    last_seen: float
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)
    snapshots: list[SavedPath] = field(default_factory=list)  # save_weights_for_sampler without a name


@dataclass
class TrainingModel:
    id: str
    session: str
    spec: AdapterSpec
    next_seq: int = 1  # create_model (or the creating load) is seq 0
    waiting: dict[int, Callable[[], None]] = field(default_factory=dict)


@dataclass
class Sampler:
    id: str
    session: str
    key: str  # the worker's name for its weights: BASE, or the saved path
    directory: str | None
    spec: AdapterSpec | None
    model_path: str | None


@dataclass(frozen=True)
class ServedModel:
    """What clients see of the base model."""

    name: str
    directory: str  # the model's local directory: its tokenizer is what get_info names
    arch: str
    vocab_size: int
    max_context: int
    parts: frozenset[str]


class ServiceState:
    """What every part of the service reads and writes; ``TrainingService`` (service.py) is all the parts."""

    def __init__(self, config: ServeConfig, backend: Backend, served: ServedModel, api_keys: dict[str, str]):
        self.config = config
        self.limits: LimitsConfig = config.limits
        self.backend = backend
        self.served = served
        self.keys = api_keys  # owner name -> key (owner names: storage.owner_of)
        self.storage = Storage(config.service.storage_dir)
        self.storage.clear_scratch()
        self.results = Results(self.limits.max_kept_results)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.executor: Executor | None = None
        self.on_worker_lost: Callable[[str], None] | None = None  # the server's stop (serve/main.py)

    def start(self) -> None:
        self.executor = Executor(
            asyncio.get_running_loop(),
            self.results.finish,
            self.limits.max_queued_requests,
            max_batch=self.limits.max_samples_per_batch,
            on_lost=self.on_worker_lost,
        )

    @property
    def worker_lost(self) -> str | None:
        """Why the worker is gone (None while it serves)."""
        return None if self.executor is None else self.executor.lost

    def stop(self) -> None:
        if self.executor is not None:
            self.executor.stop()

    def _submit(self, request_id: str | None, job: Callable[[], bytes | dict | None]) -> None:
        assert self.executor is not None
        self.executor.submit(Job(request_id, run=job))

    def _new_request(self, owner: str) -> str:
        assert self.executor is not None
        if self.executor.full():
            raise ServiceError(f"{self.limits.max_queued_requests} requests are waiting for the worker; try later", 429)
        return self.results.new(owner)

    def _fail(self, request_id: str, message: str, category: str = USER) -> None:
        self.results.finish(request_id, Outcome(error=message, category=category))

    async def retrieve(self, owner: str, request_id: str) -> Outcome | None:
        return await self.results.wait(request_id, owner, self.config.service.poll_timeout_s)

    def session(self, owner: str, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise ServiceError(f"no session {session_id!r} (unknown, ended, or not this key's)", 404)
        session.last_seen = time.monotonic()
        return session

    def model(self, owner: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or self.sessions.get(model.session) is None or self.sessions[model.session].owner != owner:
            raise ServiceError(f"no model {model_id!r} (unknown, freed, or another key's)", 404)
        self.sessions[model.session].last_seen = time.monotonic()
        return model

    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in (self.served.name, self.served.directory):
            raise ServiceError(f"this service serves {self.served.name!r}, not {base_model!r}", 400)

    def _check_token_ids(self, tokens: np.ndarray, where: str) -> None:
        if len(tokens) and (int(np.min(tokens)) < 0 or int(np.max(tokens)) >= self.served.vocab_size):
            bad = int(np.min(tokens)) if int(np.min(tokens)) < 0 else int(np.max(tokens))
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary (0..{self.served.vocab_size - 1})")

    def _spec_of(self, meta: dict, uri: str) -> AdapterSpec:
        if meta.get("base_model") != self.served.name:
            raise ValueError(
                f"{uri} was trained on {meta.get('base_model')!r}; this service serves {self.served.name!r}"
            )
        return AdapterSpec(rank=int(meta["rank"]), parts=frozenset(meta["parts"]), scaling=float(meta["scaling"]))

    def spec(self, rank: int, parts: frozenset[str]) -> AdapterSpec:
        return AdapterSpec(rank=rank, parts=parts, scaling=self.config.model.lora_alpha / rank)
