"""Training models and their queues: LoRA adapters created on the base model, and each model's requests run in their
``seq_id`` order (a later chunk that arrives first waits for the earlier ones); forward_backward's datums checked
against every bound before they reach the worker; the optimizer step."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from hybridflow.algorithms.datum_losses import TARGET_TOKENS, Datum
from hybridflow.algorithms.objectives import datum_objective
from hybridflow.models.adapters import ATTN, MLP, UNEMBED
from hybridflow.serve import messages as m
from hybridflow.serve.futures import ServiceError
from hybridflow.serve.state import ServiceState, Session, TrainingModel
from hybridflow.serve.storage import PathError
from hybridflow.serve.wire import (
    ForwardBackwardCall,
    encode_forward_backward_output,
)
from hybridflow.workers.adapter_service import AdapterSpec

MAX_SEQ_AHEAD = 100_000  # how far ahead of the next expected seq_id a request may arrive


class TrainingPart(ServiceState):
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
        loss = datum_objective(call.loss_fn)
        loss.checked(call.loss_fn_config)
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
