"""The training service's worker (``hybridflow serve``): many clients' LoRA adapters over one base model.

One base model is held once, FSDP2-sharded with an adapter slot (engine/adapter_slots.py); each adapter (a
training client's model) keeps its own tensors, AdamW state and gradients and is moved into the slot for its
request. Training requests run datum passes (engine/datum_pass.py); sampling runs on the rollout engine, which
serves a sampler's saved adapters over its own copy of the base, and prompt log-probs come from the training
model in fp32 (the same numbers a ``forward`` would give). The service calls one method at a time.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridflow.algorithms.datum_losses import TARGET_TOKENS, WEIGHTS, Datum, DatumOutput
from hybridflow.algorithms.objectives import datum_objective
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine.adapter_slots import AdapterSlots, AdapterState
from hybridflow.engine.config import FSDPConfig
from hybridflow.engine.datum_pass import run_datums
from hybridflow.engine.fsdp import grad_norm_and_clip
from hybridflow.engine.lora import ALL_LINEAR, OUTPUT_HEAD, LoraConfig, adapters_off
from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype
from hybridflow.rollout.config import RolloutConfig
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.workers.generation import build_generator
from hybridflow.workers.sharded_model import build_sharded

BASE = ""  # the sampler key of the base model without adapters
SAMPLER_ADAPTERS_KEPT = 4  # saved sampler adapters kept loaded for prompt log-probs, least recently used dropped


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter's shape: its rank, the parts it adapts (adapter_slots.ATTN, MLP, UNEMBED) and its output scaling."""

    rank: int
    parts: frozenset[str]
    scaling: float


@dataclass(frozen=True)
class SampleSpec:
    """One sampling request: ``num_samples`` responses to ``prompt``. ``stop_token_ids``: None ends at the model's
    EOS, [] never; ``stop_strings``: the response ends after the first token that completes one (EOS too)."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: list[int] | None
    stop_strings: list[str]
    prompt_logprobs: bool


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None  # one per prompt token, NaN at position 0


class AdapterServiceWorker(Worker):
    """model_path: the base model's directory; max_lora_rank: the slot's rank (the highest an adapter may have)."""

    def __init__(
        self,
        *,
        model_path: str,
        max_lora_rank: int,
        fsdp: FSDPConfig,
        rollout: RolloutConfig,
        max_tokens_per_micro_batch: int,
        seed: int,
    ):
        super().__init__()
        self.tokenizer = load_tokenizer(model_path)
        self.max_tokens = max_tokens_per_micro_batch
        targets = [ALL_LINEAR, OUTPUT_HEAD]  # every part a client may choose (train_attn, train_mlp, train_unembed)
        slot = LoraConfig(
            rank=max_lora_rank, alpha=float(max_lora_rank), dropout=0.0, target_modules=targets, target_parameters=[]
        )
        with warnings.catch_warnings():  # peft's warning of an adapter on a tied head: served apart, never merged
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            model = build_sharded(load_causal_lm, model_path, fsdp, self.device, seed, lora=slot)
        self.slots = AdapterSlots(model, max_lora_rank)
        self.vocab_size = int(model.config.vocab_size)
        self.rollout = build_generator(
            model_path,
            self.tokenizer,
            rollout,
            dtype=parse_dtype(rollout.dtype, self.device),
            device=self.device,
            group=None,
            tool_config="",
            default_agent="",
        )
        self.rollout_adapter: str | None = BASE  # the sampler whose adapters the rollout serves now
        self.sampler_adapters: OrderedDict[str, None] = OrderedDict()

    @property
    def model(self) -> torch.nn.Module:
        return self.slots.model

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        """What the service tells clients: the vocabulary size and the parts an adapter may reach."""
        return {"vocab_size": self.vocab_size, "parts": sorted(self.slots.available_parts)}

    # --- training clients' adapters ---

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def create_adapter(self, key: str, spec: AdapterSpec, seed: int) -> None:
        self.slots.create(key, rank=spec.rank, parts=spec.parts, scaling=spec.scaling, seed=seed)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def drop_adapter(self, key: str) -> None:
        self.slots.drop(key)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def forward_backward(
        self, key: str, datums: list[Datum], loss_name: str, config: dict[str, float], forward_only: bool
    ) -> tuple[list[DatumOutput], float]:
        """Each datum's log-probs and per-token loss and the summed loss; unless ``forward_only`` its gradient is
        added to adapter ``key``'s."""
        objective = datum_objective(loss_name)(config)
        self.slots.activate(key)
        self.model.train(not forward_only)
        return run_datums(
            self.model,
            datums,
            objective,
            backward=not forward_only,
            max_tokens=self.max_tokens,
            device=self.device,
            loss_scale=float(self.world_size),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def optim_step(
        self, key: str, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, grad_clip_norm: float
    ) -> dict[str, float]:
        """AdamW on adapter ``key``'s accumulated gradients (clipped to ``grad_clip_norm`` when > 0), which are
        then cleared."""
        self.slots.activate(key)
        grad_norm = grad_norm_and_clip(self.model, grad_clip_norm if grad_clip_norm > 0 else math.inf)
        self.slots.step(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": lr}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_adapter(self, key: str, directory: str, with_optimizer: bool) -> None:
        self.slots.save(key, Path(directory), with_optimizer=with_optimizer, write=self.rank == 0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_adapter(self, key: str, directory: str, spec: AdapterSpec, with_optimizer: bool) -> None:
        self.slots.load(
            key, Path(directory), rank=spec.rank, parts=spec.parts, scaling=spec.scaling, with_optimizer=with_optimizer
        )

    # --- sampling ---

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def forget_sampler(self, sampler: str) -> None:
        """Drop what is held of sampler ``sampler``'s weights (its adapter, and the rollout's copy if it serves
        them): its path was saved again, and the next sample reads the new weights from it."""
        if sampler == BASE:
            return
        if self.rollout_adapter == sampler:
            self.rollout_adapter = None
        if sampler in self.sampler_adapters:
            del self.sampler_adapters[sampler]
            self.slots.drop(sampler)

    def _sampler_state(self, sampler: str, directory: str | None, spec: AdapterSpec | None) -> AdapterState | None:
        """The sampler's adapter, loaded (and kept, a few at a time) from its saved directory; None: the base."""
        if sampler == BASE:
            return None
        if sampler not in self.slots.adapters:
            if directory is None or spec is None:
                raise ValueError(f"sampler {sampler!r} has no saved weights")
            self.slots.load(
                sampler, Path(directory), rank=spec.rank, parts=spec.parts, scaling=spec.scaling, with_optimizer=False
            )
            self.sampler_adapters[sampler] = None
            while len(self.sampler_adapters) > SAMPLER_ADAPTERS_KEPT:
                evicted, _ = self.sampler_adapters.popitem(last=False)
                if self.rollout_adapter == evicted:
                    self.rollout_adapter = None
                self.slots.drop(evicted)
        self.sampler_adapters.move_to_end(sampler)
        return self.slots.adapters[sampler]

    def _serve_adapters(self, sampler: str, state: AdapterState | None) -> None:
        if self.rollout_adapter == sampler:
            return
        if state is None:
            self.rollout.load_adapters([], 1.0)
        else:
            self.rollout.load_adapters(self.slots.adapter_tensors(sampler).items(), state.scaling)
        self.rollout_adapter = sampler

    @torch.no_grad()
    def _prompt_logprobs(self, sampler: str, state: AdapterState | None, prompts: list[list[int]]) -> list[list[float]]:
        """log p(prompt[i] | prompt[:i]) for i >= 1 of each prompt under the training model in fp32, NaN first
        (nothing before it): the prompts go through together, in micro-batches (``compute_logprobs`` calls of a
        distillation step, one per sample, batch up as samples do)."""
        out = [[math.nan] for _ in prompts]
        scored = [i for i, prompt in enumerate(prompts) if len(prompt) >= 2]
        if not scored:
            return out
        datums = [
            Datum(
                np.asarray(prompts[i][:-1], dtype=np.int64),
                {TARGET_TOKENS: np.asarray(prompts[i][1:], dtype=np.int64), WEIGHTS: np.zeros(len(prompts[i]) - 1)},
            )
            for i in scored
        ]
        self.model.eval()
        if state is not None:
            self.slots.activate(sampler)
        with adapters_off(self.model) if state is None else contextlib.nullcontext():
            scoring = datum_objective("cross_entropy")()  # zero weights: the log-probs alone
            outputs, _ = run_datums(
                self.model, datums, scoring, backward=False, max_tokens=self.max_tokens, device=self.device
            )
        for i, output in zip(scored, outputs):
            out[i] = [math.nan, *output.logprobs.tolist()]
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sample(
        self, sampler: str, directory: str | None, spec: AdapterSpec | None, requests: list[SampleSpec]
    ) -> list[SampleResult]:
        """Each request's responses from the sampler's weights (``BASE``: the base model's), generated together.
        The requests share their sampling settings but for the prompt, the count and the seed (the service batches
        them so), and each samples from its own seed as it would alone."""
        state = self._sampler_state(sampler, directory, spec)
        wanted = [r.prompt for r in requests if r.prompt_logprobs]
        scored = iter(self._prompt_logprobs(sampler, state, wanted) if wanted else [])
        prompt_logprobs = [next(scored) if r.prompt_logprobs else None for r in requests]
        self._serve_adapters(sampler, state)
        first = requests[0]
        greedy = first.temperature <= 0
        params = SamplingParams(
            do_sample=not greedy,
            temperature=1.0 if greedy else first.temperature,
            top_p=first.top_p,
            top_k=first.top_k,
            max_new_tokens=first.max_tokens,
            seed=first.seed,
        )
        prompts, seeds, streams = [], [], []
        for request in requests:
            for stream in range(request.num_samples):
                prompts.append(request.prompt)
                seeds.append(request.seed)
                streams.append(stream)
        samples = iter(
            self.rollout.generate_tokens(prompts, params, first.stop_token_ids, seeds=seeds, streams=streams)
        )
        results = []
        for request, values in zip(requests, prompt_logprobs):
            mine = [next(samples) for _ in range(request.num_samples)]
            sequences = [self._cut_at_strings(s.tokens, s.log_probs, s.stopped, request.stop_strings) for s in mine]
            results.append(SampleResult(sequences, values))
        return results

    def _cut_at_strings(
        self, tokens: list[int], logprobs: list[float], stopped: bool, stops: list[str]
    ) -> SampledSequence:
        """The response up to and including the first token whose text completes one of ``stops``."""
        if stops and any(stop in self.tokenizer.decode(tokens) for stop in stops):
            for end in range(1, len(tokens) + 1):
                text = self.tokenizer.decode(tokens[:end])
                if any(stop in text for stop in stops):
                    return SampledSequence(tokens[:end], logprobs[:end], "stop")
        return SampledSequence(tokens, logprobs, "stop" if stopped else "length")
