"""The training service's state and rules, without HTTP: sessions, training models and samplers, futures, the
order of a model's requests, and the bounds on what a client may ask.

Everything here runs on the server's event loop, one call at a time, so the state needs no locks. Work for the
worker goes to one executor thread, in the order it is submitted: a model's requests in their ``seq_id`` order
(a later chunk that arrives first waits for the earlier ones), samples as they come. A request is answered at
once with a future; its result (or its error, with the category the SDK reports) is fetched by
``retrieve_future``. A client's mistake fails only its own request: models, samplers and results are each
owned by one session (saved paths by one API key), and nothing one client sends reaches another's state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hybridflow.algorithms.datum_losses import DATUM_LOSSES, TARGET_TOKENS, loss_settings
from hybridflow.engine.adapter_slots import ATTN, MLP, UNEMBED
from hybridflow.engine.datum_pass import Datum
from hybridflow.serve import messages as m
from hybridflow.serve.futures import USER, Executor, Job, Outcome, Results, ServiceError
from hybridflow.serve.storage import PathError, SavedPath, Storage, check_name, parse_path
from hybridflow.serve.wire import (
    EncodedSequence,
    ForwardBackwardCall,
    encode_forward_backward_output,
    encode_sample_response,
)
from hybridflow.trainer.setup.serve_config import LimitsConfig, ServeConfig
from hybridflow.workers.adapter_service import BASE, AdapterSpec, SampleResult, SampleSpec

log = logging.getLogger("hybridflow.serve")

MAX_SEQ_AHEAD = 100_000  # how far ahead of the next expected seq_id a request may arrive
# The least a datum the SDK sends can weigh per token in the SDK's estimate of a forward_backward chunk (tinker 0.38.0,
# training_client._estimate_datum_bytes_count_proto): its token (int32, 4 bytes), its target token (int64: the SDK's
# tensors are int64 or float32) and at least one float32 loss input (weights, or advantages). A chunk within
# ``tokens * SDK_MIN_BYTES_PER_TOKEN`` bytes holds at most ``tokens`` tokens.
SDK_MIN_BYTES_PER_TOKEN = 4 + 8 + 4


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


class TrainingService:
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

    # --- the service and its sessions ---

    def client_config(self) -> dict:
        """The SDK's settings for this service: plain API keys, uncompressed bodies, and forward_backward calls
        chunked within the request bounds (so a well-behaved client never meets them). The SDK takes a bound on a
        chunk's datums and one on its estimated bytes, not on its tokens: the bytes told are few enough that a chunk
        within them holds at most ``limits.max_tokens_per_request`` tokens (a single datum over them goes alone,
        and holds at most ``max_tokens_per_datum``, which is no more), and half the body bound (room for protobuf's
        framing, which the estimate leaves out)."""
        limits = self.limits
        chunk_bytes = min(limits.max_body_bytes // 2, limits.max_tokens_per_request * SDK_MIN_BYTES_PER_TOKEN)
        return {
            "pjwt_auth_enabled": False,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_len": limits.max_datums_per_request,
            "fwdbwd_max_chunk_bytes_count": chunk_bytes,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
            "use_pyqwest_transport": False,
        }

    def capabilities(self) -> dict:
        return {
            "supported_models": [
                {
                    "model_name": self.served.name,
                    "max_context_length": self.served.max_context,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    def create_session(self, owner: str, request: m.CreateSession) -> dict:
        self.expire_sessions()
        if len(self.sessions) >= self.limits.max_sessions:
            raise ServiceError(f"the service holds its limit of {self.limits.max_sessions} sessions; try later", 400)
        session = Session(uuid.uuid4().hex, owner, time.monotonic())
        self.sessions[session.id] = session
        log.info("session %s started (%s)", session.id, request.display_name or "unnamed")
        return {"type": "create_session", "session_id": session.id}

    def session(self, owner: str, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise ServiceError(f"no session {session_id!r} (unknown, ended, or not this key's)", 404)
        session.last_seen = time.monotonic()
        return session

    def heartbeat(self, owner: str, session_id: str) -> dict:
        self.session(owner, session_id)
        return {"type": "session_heartbeat"}

    def end_session(self, session: Session) -> None:
        """Free what the session held: its models' adapters and its snapshots."""
        self.sessions.pop(session.id, None)
        for model_id in sorted(session.models):
            self.models.pop(model_id, None)
            self._submit(None, lambda key=model_id: self.backend.drop_adapter(key))
        for sampler_id in session.samplers:
            self.samplers.pop(sampler_id, None)
        for snapshot in session.snapshots:
            self._submit(None, lambda saved=snapshot: self.storage.remove(saved))
        log.info("session %s ended: %d models freed", session.id, len(session.models))

    def expire_sessions(self) -> None:
        deadline = time.monotonic() - self.config.service.session_timeout_s
        for session in [s for s in self.sessions.values() if s.last_seen < deadline]:
            log.info("session %s sent no heartbeat for %.0f s", session.id, self.config.service.session_timeout_s)
            self.end_session(session)

    # --- futures ---

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

    # --- training models ---

    def model(self, owner: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or self.sessions.get(model.session) is None or self.sessions[model.session].owner != owner:
            raise ServiceError(f"no model {model_id!r} (unknown, freed, or another key's)", 404)
        self.sessions[model.session].last_seen = time.monotonic()
        return model

    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in (self.served.name, self.served.directory):
            raise ServiceError(f"this service serves {self.served.name!r}, not {base_model!r}", 400)

    def _room_for_model(self, session: Session, model_id: str) -> None:
        if model_id in self.models:
            raise ServiceError(f"model {model_id} exists (model_seq_id already used in this session)", 400)
        if len(session.models) >= self.limits.max_models_per_session:
            raise ServiceError(f"a session holds at most {self.limits.max_models_per_session} models", 400)
        if len(self.models) >= self.limits.max_models:
            raise ServiceError(f"the service holds its limit of {self.limits.max_models} models; try later", 400)

    def _add_model(self, session: Session, model_id: str, spec: AdapterSpec) -> TrainingModel:
        model = TrainingModel(model_id, session.id, spec)
        self.models[model_id] = model
        session.models.add(model_id)
        return model

    def spec(self, rank: int, parts: frozenset[str]) -> AdapterSpec:
        return AdapterSpec(rank=rank, parts=parts, scaling=self.config.model.lora_alpha / rank)

    def create_model(self, owner: str, request: m.CreateModel) -> dict:
        session = self.session(owner, request.session_id)
        self._check_base(request.base_model)
        if request.lora_config is None:
            raise ServiceError("this service trains LoRA adapters: give a lora_config (rank)", 400)
        if request.optimizer_config.type != "adamw":
            raise ServiceError(f"optimizer {request.optimizer_config.type!r}: this service has AdamW only", 400)
        lora = request.lora_config
        if lora.rank > self.config.model.max_lora_rank:
            raise ServiceError(
                f"LoRA rank {lora.rank} is above this service's max_lora_rank {self.config.model.max_lora_rank}"
            )
        chosen = ((ATTN, lora.train_attn), (MLP, lora.train_mlp), (UNEMBED, lora.train_unembed))
        parts = frozenset(part for part, on in chosen if on)
        if not parts:
            raise ServiceError("train_attn, train_mlp and train_unembed are all off: an adapter needs one of them")
        model_id = f"{session.id}:train:{request.model_seq_id}"
        self._room_for_model(session, model_id)
        model = self._add_model(session, model_id, self.spec(lora.rank, parts))
        request_id = self._new_request(owner)
        seed = lora.seed if lora.seed is not None else int.from_bytes(os.urandom(4), "little")

        def create() -> dict:
            self.backend.create_adapter(model.id, model.spec, seed)
            return {"type": "create_model", "model_id": model.id}

        self._submit(request_id, create)
        return {"request_id": request_id, "model_id": model_id}

    def get_info(self, owner: str, model_id: str) -> dict:
        model = self.model(owner, model_id)
        return {
            "type": "get_info",
            "model_data": {
                "arch": self.served.arch,
                "model_name": self.served.name,
                "tokenizer_id": self.served.directory,
            },
            "model_id": model.id,
            "is_lora": True,
            "lora_rank": model.spec.rank,
            "model_name": self.served.name,
        }

    def _in_order(self, model: TrainingModel, seq_id: int, run: Callable[[], None]) -> None:
        """Run ``run`` (which submits the request) once every earlier seq_id of the model has been submitted."""
        if seq_id < model.next_seq or seq_id in model.waiting:
            raise ServiceError(f"seq_id {seq_id} of model {model.id} was already used", 400)
        if seq_id > model.next_seq + MAX_SEQ_AHEAD:
            raise ServiceError(f"seq_id {seq_id} is too far ahead of the model's next ({model.next_seq})", 400)
        model.waiting[seq_id] = run
        while model.next_seq in model.waiting:
            model.waiting.pop(model.next_seq)()
            model.next_seq += 1

    def _ordered_job(
        self, owner: str, model_id: str, seq_id: int, prepare: Callable[[TrainingModel], Callable]
    ) -> dict:
        """A model request's future: ``prepare(model)`` checks the request (a ValueError fails the future, in its
        turn) and gives the job, submitted when its turn comes."""
        model = self.model(owner, model_id)
        request_id = self._new_request(owner)
        try:
            job = prepare(model)
        except (ValueError, PathError) as error:
            message = str(error)
            self._in_order(model, seq_id, lambda: self._fail(request_id, message))
        else:
            self._in_order(model, seq_id, lambda: self._submit(request_id, job))
        return {"request_id": request_id, "model_id": model_id}

    def forward_backward(self, owner: str, call: ForwardBackwardCall) -> dict:
        def prepare(model: TrainingModel) -> Callable:
            datums = self._datums(call)
            settings = dict(call.loss_fn_config)

            def run() -> bytes:
                start = time.perf_counter()
                outputs, loss = self.backend.forward_backward(
                    model.id, datums, call.loss_fn, settings, call.forward_only
                )
                fields = {
                    "logprobs": [o.logprobs for o in outputs],
                    "elementwise_loss": [o.elementwise_loss for o in outputs],
                }
                metrics = {
                    "loss:sum": loss,
                    "num_tokens:sum": float(sum(len(d.tokens) for d in datums)),
                    "worker_seconds:sum": time.perf_counter() - start,  # the call on the worker, without the HTTP
                }
                return encode_forward_backward_output(fields, metrics)

            return run

        return self._ordered_job(owner, call.model_id, call.seq_id, prepare)

    def _datums(self, call: ForwardBackwardCall) -> list[Datum]:
        """The call's datums, every bound and input checked (ValueError naming the datum and what is wrong)."""
        limits = self.limits
        loss = DATUM_LOSSES.get(call.loss_fn)
        if loss is None:
            raise ValueError(f"loss_fn {call.loss_fn!r} is not served here (this service has {sorted(DATUM_LOSSES)})")
        loss_settings(call.loss_fn, call.loss_fn_config)
        if not call.tokens:
            raise ValueError("forward_backward with no datums")
        if len(call.tokens) > limits.max_datums_per_request:
            raise ValueError(f"{len(call.tokens)} datums in one request; at most {limits.max_datums_per_request}")
        total = sum(len(t) for t in call.tokens)
        if total > limits.max_tokens_per_request:
            raise ValueError(f"{total} tokens in one request; at most {limits.max_tokens_per_request}")
        needed = (TARGET_TOKENS, *loss.inputs)
        datums = []
        for index, (tokens, inputs) in enumerate(zip(call.tokens, call.inputs)):
            n = len(tokens)
            if not 1 <= n <= min(limits.max_tokens_per_datum, self.served.max_context):
                raise ValueError(f"datum {index}: {n} tokens; a datum has 1 to {limits.max_tokens_per_datum}")
            self._check_token_ids(tokens, f"datum {index}")
            missing = [name for name in needed if name not in inputs]
            if missing:
                raise ValueError(f"datum {index}: {call.loss_fn} needs loss inputs {missing} (it reads {list(needed)})")
            extra = sorted(set(inputs) - set(needed))
            if extra:
                raise ValueError(f"datum {index}: {call.loss_fn} does not read {extra} (it reads {list(needed)})")
            for name in needed:
                if len(inputs[name]) != n:
                    raise ValueError(f"datum {index}: {name} has {len(inputs[name])} values for {n} tokens")
                if not np.isfinite(inputs[name]).all():
                    raise ValueError(f"datum {index}: {name} holds a NaN or an infinity")
            self._check_token_ids(inputs[TARGET_TOKENS], f"datum {index} target_tokens")
            datums.append(Datum(tokens, {name: inputs[name] for name in needed}))
        return datums

    def _check_token_ids(self, tokens: np.ndarray, where: str) -> None:
        if len(tokens) and (int(np.min(tokens)) < 0 or int(np.max(tokens)) >= self.served.vocab_size):
            bad = int(np.min(tokens)) if int(np.min(tokens)) < 0 else int(np.max(tokens))
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary (0..{self.served.vocab_size - 1})")

    def optim_step(self, owner: str, request: m.OptimStep) -> dict:
        def prepare(model: TrainingModel) -> Callable:
            if request.adam_params is None:
                raise ValueError("this service's optimizer is AdamW: send adam_params")
            adam = request.adam_params
            settings = dict(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
                grad_clip_norm=adam.grad_clip_norm,
            )

            def run() -> dict:
                start = time.perf_counter()
                metrics = self.backend.optim_step(model.id, **settings)
                return {"type": "optim_step", "metrics": {**metrics, "worker_seconds:sum": time.perf_counter() - start}}

            return run

        return self._ordered_job(owner, request.model_id, request.seq_id, prepare)

    # --- saving and loading ---

    def _meta(self, model: TrainingModel, with_optimizer: bool) -> dict:
        return {
            "base_model": self.served.name,
            "rank": model.spec.rank,
            "parts": sorted(model.spec.parts),
            "scaling": model.spec.scaling,
            "with_optimizer": with_optimizer,
            "saved_at": time.time(),
        }

    def _save_job(self, owner: str, model: TrainingModel, saved: SavedPath, with_optimizer: bool, overwrite: bool):
        meta = self._meta(model, with_optimizer)

        def write(scratch: Path) -> None:
            self.backend.save_adapter(model.id, str(scratch), with_optimizer)

        def save() -> None:
            self.storage.save(saved, owner, meta, write, overwrite=overwrite)
            # a sampler of this path reads the new weights from now on, not what the worker holds of the old ones
            self.backend.forget_sampler(saved.uri)

        return save

    def save_weights(self, owner: str, request: m.SaveWeights) -> dict:
        def prepare(model: TrainingModel) -> Callable:
            name = request.path or f"step-{request.seq_id}"
            check_name(name)
            saved = parse_path(f"tinker://{model.id}/weights/{name}")
            save = self._save_job(owner, model, saved, True, request.overwrite)

            def run() -> dict:
                save()
                return {"type": "save_weights", "path": saved.uri}

            return run

        return self._ordered_job(owner, request.model_id, request.seq_id, prepare)

    def save_weights_for_sampler(self, owner: str, request: m.SaveWeightsForSampler) -> dict:
        def prepare(model: TrainingModel) -> Callable:
            session = self.sessions[model.session]
            if request.path is None and request.sampling_session_seq_id is None:
                raise ValueError("give a path (a name) or a sampling_session_seq_id")
            if request.path is not None:
                check_name(request.path)
                saved = parse_path(f"tinker://{model.id}/sampler_weights/{request.path}")
            else:
                saved = parse_path(f"tinker://{model.id}/sampler_weights/snapshot-{uuid.uuid4().hex[:12]}")
                session.snapshots.append(saved)
                sampler_id = self._sampler_id(session, request.sampling_session_seq_id)
            save = self._save_job(owner, model, saved, False, request.path is not None)

            def run() -> dict:
                save()
                if request.path is not None:
                    return {"type": "save_weights_for_sampler", "path": saved.uri}
                self.samplers[sampler_id] = Sampler(
                    sampler_id, session.id, saved.uri, str(self.storage.directory(saved)), model.spec, saved.uri
                )
                session.samplers.add(sampler_id)
                return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

            return run

        return self._ordered_job(owner, request.model_id, request.seq_id, prepare)

    def _spec_of(self, meta: dict, uri: str) -> AdapterSpec:
        if meta.get("base_model") != self.served.name:
            raise ValueError(
                f"{uri} was trained on {meta.get('base_model')!r}; this service serves {self.served.name!r}"
            )
        return AdapterSpec(rank=int(meta["rank"]), parts=frozenset(meta["parts"]), scaling=float(meta["scaling"]))

    def load_weights(self, owner: str, request: m.LoadWeights) -> dict:
        """Into an existing model (``model_id`` and ``seq_id``), or creating one (``session_id`` and
        ``model_seq_id``: the load is its first request)."""
        try:
            saved, directory, meta = self.storage.read(request.path, owner)
            spec = self._spec_of(meta, request.path)
        except PathError as error:
            raise ServiceError(str(error), error.status) from None
        except ValueError as error:
            raise ServiceError(str(error)) from None
        if request.optimizer and not meta.get("with_optimizer"):
            raise ServiceError(f"{request.path} holds no optimizer state (saved for sampling); load it without", 400)
        if request.session_id is not None:
            if request.model_seq_id is None:
                raise ServiceError("a load that creates a model needs model_seq_id", 400)
            session = self.session(owner, request.session_id)
            self._check_base(request.base_model)
            model_id = f"{session.id}:train:{request.model_seq_id}"
            self._room_for_model(session, model_id)
            model = self._add_model(session, model_id, spec)
            request_id = self._new_request(owner)
            self._submit(request_id, self._load_job(model, directory, spec, request, fresh=True))
            return {"request_id": request_id, "model_id": model_id}
        if request.model_id is None or request.seq_id is None:
            raise ServiceError("load_weights needs model_id and seq_id, or session_id and model_seq_id", 400)

        def prepare(model: TrainingModel) -> Callable:
            if (model.spec.rank, model.spec.parts) != (spec.rank, spec.parts):
                raise ValueError(
                    f"{request.path} is rank {spec.rank} on {sorted(spec.parts)}; model {model.id} is rank "
                    f"{model.spec.rank} on {sorted(model.spec.parts)}"
                )
            return self._load_job(model, directory, spec, request, fresh=False)

        return self._ordered_job(owner, request.model_id, request.seq_id, prepare)

    def _load_job(self, model: TrainingModel, directory: Path, spec: AdapterSpec, request: m.LoadWeights, fresh: bool):
        def run() -> dict:
            if not fresh:
                self.backend.drop_adapter(model.id)
            self.backend.load_adapter(model.id, str(directory), spec, request.optimizer)
            return {"type": "load_weights", "path": request.path, "model_id": model.id}

        return run

    # --- sampling ---

    def _sampler_id(self, session: Session, seq_id: int) -> str:
        sampler_id = f"{session.id}:sample:{seq_id}"
        if sampler_id in self.samplers:
            raise ValueError(f"sampling session {sampler_id} exists (sampling_session_seq_id already used)")
        if len(session.samplers) >= self.limits.max_samplers_per_session:
            raise ValueError(f"a session opens at most {self.limits.max_samplers_per_session} sampling sessions")
        return sampler_id

    def create_sampling_session(self, owner: str, request: m.CreateSamplingSession) -> dict:
        session = self.session(owner, request.session_id)
        try:
            sampler_id = self._sampler_id(session, request.sampling_session_seq_id)
            sampler = self._sampler(session, sampler_id, request.model_path, request.base_model)
        except PathError as error:
            raise ServiceError(str(error), error.status) from None
        except ValueError as error:
            raise ServiceError(str(error)) from None
        self.samplers[sampler_id] = sampler
        session.samplers.add(sampler_id)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _sampler(self, session: Session, sampler_id: str, model_path: str | None, base_model: str | None) -> Sampler:
        if model_path is None:
            if base_model is None:
                raise ValueError("give a model_path (tinker://...) or a base_model to sample from")
            self._check_base(base_model)
            return Sampler(sampler_id, session.id, BASE, None, None, None)
        _, directory, meta = self.storage.read(model_path, session.owner)
        return Sampler(sampler_id, session.id, model_path, str(directory), self._spec_of(meta, model_path), model_path)

    def get_sampler(self, owner: str, sampler_id: str) -> dict:
        sampler = self.samplers.get(sampler_id)
        if (
            sampler is None
            or self.sessions.get(sampler.session) is None
            or self.sessions[sampler.session].owner != owner
        ):
            raise ServiceError(f"no sampling session {sampler_id!r}", 404)
        return {"sampler_id": sampler.id, "base_model": self.served.name, "model_path": sampler.model_path}

    def sample(self, owner: str, request: m.Sample) -> dict:
        if request.sampling_session_id is not None:
            self.get_sampler(owner, request.sampling_session_id)
            sampler = self.samplers[request.sampling_session_id]
            self.sessions[sampler.session].last_seen = time.monotonic()
        else:  # older clients name the weights in each request
            owned = [s for s in self.sessions.values() if s.owner == owner]
            if not owned:
                raise ServiceError("sample without a sampling_session_id needs a live session of this key", 400)
            try:
                sampler = self._sampler(owned[0], "direct", request.model_path, request.base_model)
            except PathError as error:
                raise ServiceError(str(error), error.status) from None
            except ValueError as error:
                raise ServiceError(str(error)) from None
        spec = self._sample_spec(request)
        request_id = self._new_request(owner)
        last_n = request.prompt_logprobs_last_n

        def encode(result: SampleResult) -> bytes:
            prompt_logprobs = result.prompt_logprobs
            if prompt_logprobs is not None and last_n is not None:
                prompt_logprobs = [float("nan")] * (len(prompt_logprobs) - last_n) + prompt_logprobs[-last_n:]
            sequences = [EncodedSequence(s.tokens, s.logprobs, s.stop_reason) for s in result.sequences]
            return encode_sample_response(sequences, prompt_logprobs)

        def run_many(jobs: list[Job]) -> list[bytes]:
            results = self.backend.sample(sampler.key, sampler.directory, sampler.spec, [j.data[0] for j in jobs])
            return [j.data[1](result) for j, result in zip(jobs, results)]

        assert self.executor is not None
        self.executor.submit(
            Job(
                request_id,
                batch_key=_batch_key(sampler, spec),
                run_many=run_many,
                size=spec.num_samples,
                data=(spec, encode),
            )
        )
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(spec.num_samples)]}

    def _sample_spec(self, request: m.Sample) -> SampleSpec:
        limits = self.limits
        unsupported = {
            "topk_prompt_logprobs": request.topk_prompt_logprobs > 0,
            "topk_sample_logprobs": request.topk_sample_logprobs > 0,
            "target_prompt_logprobs": request.target_prompt_logprobs is not None,
            "prompt_alt_tokens_k": request.prompt_alt_tokens_k > 0,
            "record_stability_info": bool(request.record_stability_info),
        }
        asked = [name for name, on in unsupported.items() if on]
        if asked:
            raise ServiceError(f"{asked}: not served by this service (see docs/serve.md)", 400)
        tokens: list[int] = []
        for chunk in request.prompt.chunks:
            if chunk.type != "encoded_text":
                raise ServiceError(f"prompt chunk of type {chunk.type!r}: only text (encoded_text) is taken", 400)
            if chunk.tokens is None:
                raise ServiceError("a prompt chunk without tokens", 400)
            tokens.extend(chunk.tokens)
        if not 1 <= len(tokens) <= min(limits.max_tokens_per_datum, self.served.max_context):
            raise ServiceError(
                f"a prompt of {len(tokens)} tokens; prompts have 1 to {limits.max_tokens_per_datum}", 400
            )
        try:
            self._check_token_ids(np.asarray(tokens), "prompt")
        except ValueError as error:
            raise ServiceError(str(error)) from None
        if request.num_samples > limits.max_samples_per_request:
            raise ServiceError(f"num_samples {request.num_samples}; at most {limits.max_samples_per_request}", 400)
        params = request.sampling_params
        max_tokens = params.max_tokens or limits.max_new_tokens
        if max_tokens > limits.max_new_tokens:
            raise ServiceError(f"max_tokens {max_tokens}; at most {limits.max_new_tokens}", 400)
        last_n = request.prompt_logprobs_last_n
        if last_n is not None and not (request.prompt_logprobs and 1 <= last_n <= len(tokens) - 1):
            raise ServiceError("prompt_logprobs_last_n needs prompt_logprobs and 1 <= N <= len(prompt) - 1", 400)
        stop_ids, stop_strings = _stops(params.stop)
        if stop_ids is not None and stop_ids:
            try:
                self._check_token_ids(np.asarray(stop_ids), "stop")
            except ValueError as error:
                raise ServiceError(str(error)) from None
        if params.top_k == 0 or params.top_k < -1:
            raise ServiceError(f"top_k {params.top_k}: -1 (off) or a positive count", 400)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        return SampleSpec(
            prompt=tokens,
            num_samples=request.num_samples,
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=seed,
            stop_token_ids=stop_ids,
            stop_strings=stop_strings,
            prompt_logprobs=bool(request.prompt_logprobs),
        )


def _batch_key(sampler: Sampler, spec: SampleSpec) -> tuple:
    """Samples with equal keys run as one generation: the same weights and every setting but prompt, count, seed."""
    stops = None if spec.stop_token_ids is None else tuple(spec.stop_token_ids)
    settings = (spec.max_tokens, spec.temperature, spec.top_p, spec.top_k, stops, tuple(spec.stop_strings))
    return (sampler.key, sampler.directory, *settings)


def _stops(stop: str | list | None) -> tuple[list[int] | None, list[str]]:
    """(stop token ids: None for the model's EOS, [] for none; stop strings)."""
    if stop is None:
        return None, []
    if isinstance(stop, str):
        return None, [stop]
    if not stop:
        return [], []
    if all(isinstance(s, str) for s in stop):
        return None, [s for s in stop if s]
    return [int(s) for s in stop], []
