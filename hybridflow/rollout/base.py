"""The interface every generation backend implements, and the response post-processing they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridflow.batch_keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
)
from hybridflow.protocol import DataProto
from hybridflow.rollout.adapter_merge import AdapterMerge
from hybridflow.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from hybridflow.rollout.requests import RequestEngine

__all__ = [
    "BackendWrapper",
    "Rollout",
    "SamplingParams",
    "TokenSample",
    "assemble_batch",
    "response_mask_from",
    "stop_and_pad_ids",
    "truncated_rows",
]


@dataclass(frozen=True)
class TokenSample:
    """One generated response of ``Rollout.generate_tokens``."""

    tokens: list[int]
    log_probs: list[float]
    stopped: bool  # it ended at a stop token (else at the length budget)


class Rollout(ABC):
    """Generates responses for left-padded prompts; the batch layout is the same for every backend."""

    reload_needs_every_weight = False  # load_weights must be given every weight of the model each time
    # load_weights casts each tensor as it copies it into the generator's own: whole weights may come in the trainer's
    # dtype (hybrid_engine/reshard.py ``generation_weights``'s ``cast_whole``), a pass over them fewer than a cast first
    load_casts = False

    @abstractmethod
    def generate_sequences(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """prompts: input_ids, attention_mask, position_ids (B, P). Returns a DataProto with
        prompts (B, P), responses (B, R), input_ids / attention_mask / position_ids (B, P+R),
        response_mask (B, R) and rollout_log_probs (B, R), R = params.max_new_tokens."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite the generator's weights in place from (HF parameter name, full tensor) pairs, one at a time."""

    def load_base_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A LoRA policy's frozen base (``load_weights``'s pairs, adapted layers without their adapters), once,
        before its adapters (``load_adapters``). By default the engine takes the weights and this side keeps a
        copy to merge the adapters into (rollout/adapter_merge.py)."""
        self._adapter_merge = AdapterMerge(every_weight=self.reload_needs_every_weight)
        self.load_weights(self._adapter_merge.keep(named_tensors))

    def load_adapters(self, adapters: Iterable[tuple[str, torch.Tensor]], scaling: float) -> None:
        """A LoRA policy's adapters (``<layer>.lora_A`` / ``<layer>.lora_B``, models/adapters.py), after each
        update: the engine generates with W + scaling · B A for every adapted layer from now on. By default
        merged into whole weights (rollout/adapter_merge.py)."""
        merge = getattr(self, "_adapter_merge", None)
        if merge is None:
            raise RuntimeError(f"{type(self).__name__}: load_base_weights must come before load_adapters")
        self.load_weights(merge.merged(adapters, scaling))

    @abstractmethod
    def release_cache(self) -> None:
        """Free generation memory (KV cache) until the next generation."""

    def generate_partial(
        self, prompts: DataProto, params: SamplingParams, should_stop: Callable[[], bool] | None
    ) -> DataProto:
        """Partial rollout (a backend registered with ``partial_rollout=True``): ``generate_sequences`` that
        also continues rows with a ``prefix_length`` and stops early when ``should_stop`` says so, marking
        the rows cut short in an ``interrupted`` column."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause and continue generation (partial rollout)")

    def generate_tokens(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_token_ids: list[int] | None = None,
        *,
        seeds: list[int] | None = None,
        streams: list[int] | None = None,
    ) -> list[TokenSample]:
        """Token-level generation (the training service's sampler): each prompt's sampled tokens and their
        log-probs up to and including the first of ``stop_token_ids`` (None: the model's EOS ids; []: none, every
        response runs to ``params.max_new_tokens``). Prompt i samples from stream i of ``params.seed``, or with
        ``seeds`` and ``streams`` from stream ``streams[i]`` of ``seeds[i]``: requests of several callers batched
        together then sample as each would alone."""
        raise NotImplementedError(f"{type(self).__name__} has no token-level generation; use the native backend")

    def request_engine(self) -> RequestEngine:
        """The same engine behind the asynchronous request API of multi-turn rollout (rollout/requests.py)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no request API for multi-turn rollout; use a backend that has one"
        )


class BackendWrapper(Rollout):
    """A rollout that generates through another backend's request engine (the agent loops, the agent endpoint): the
    weights, the adapters and the cache are the backend's."""

    def __init__(self, backend: Rollout):
        self.backend = backend
        self.engine = backend.request_engine()
        self.pad_token_id = backend.pad_token_id
        self.load_casts = backend.load_casts

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.backend.load_weights(named_tensors)

    def load_base_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.backend.load_base_weights(named_tensors)

    def load_adapters(self, adapters: Iterable[tuple[str, torch.Tensor]], scaling: float) -> None:
        self.backend.load_adapters(adapters, scaling)

    def release_cache(self) -> None:
        self.backend.release_cache()

    def request_engine(self) -> RequestEngine:
        return self.engine


def stop_and_pad_ids(generation_eos: int | list[int] | None, tokenizer) -> tuple[list[int], int]:
    """The token ids that end a response (the model's generation EOS and the tokenizer's), and the pad id."""
    eos = generation_eos if generation_eos is not None else tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    return eos_ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def response_mask_from(responses: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 on response tokens up to and including the first EOS, 0 after: (B, R) -> (B, R) long."""
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    eos_seen_before = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~eos_seen_before).long()


def truncated_rows(responses: torch.Tensor, response_mask: torch.Tensor, stop_token_ids: list[int]) -> torch.Tensor:
    """True for the rows whose response holds no stop token: cut at the length budget. (B, R) -> (B,) bool."""
    stops = torch.isin(responses, torch.tensor(stop_token_ids, dtype=responses.dtype, device=responses.device))
    return ~(stops & response_mask.bool()).any(dim=1)


def assemble_batch(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    pad_token_id: int,
    stop_token_ids: list[int],
) -> dict[str, torch.Tensor]:
    """The training batch of prompts + responses: positions count real tokens from the first one."""
    truncated = truncated_rows(responses, response_mask, stop_token_ids)
    responses = responses.masked_fill(response_mask == 0, pad_token_id)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        PROMPTS: prompt_ids,
        RESPONSES: responses,
        INPUT_IDS: torch.cat([prompt_ids, responses], dim=1),
        ATTENTION_MASK: attention_mask,
        POSITION_IDS: position_ids,
        RESPONSE_MASK: response_mask,
        ROLLOUT_LOG_PROBS: rollout_log_probs * response_mask,
        TRUNCATED: truncated,
    }
