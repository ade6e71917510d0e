"""Sampling: sampling sessions on the base model or on saved weights, and sample requests checked against the bounds;
waiting samples of one sampler with equal settings run as one generation (``_batch_key``)."""

from __future__ import annotations

import os
import time

import numpy as np

from hybridflow.serve import messages as m
from hybridflow.serve.futures import Job, ServiceError
from hybridflow.serve.state import Sampler, ServiceState, Session
from hybridflow.serve.storage import PathError
from hybridflow.serve.wire import (
    EncodedSequence,
    encode_sample_response,
)
from hybridflow.workers.adapter_service import BASE, SampleResult, SampleSpec


class SamplingPart(ServiceState):
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
