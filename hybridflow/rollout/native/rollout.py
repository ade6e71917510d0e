"""`NativeRollout`: the native engine behind the `Rollout` interface, a drop-in for `HFRollout`."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from hybridflow.batch_keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    INTERRUPTED,
    PREFIX_LENGTH,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
)
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import (
    Rollout,
    SamplingParams,
    TokenSample,
    assemble_batch,
    response_mask_from,
    stop_and_pad_ids,
)
from hybridflow.rollout.native.config import NativeEngineConfig
from hybridflow.rollout.native.engine import Continuation, Engine
from hybridflow.rollout.native.engine_stats import EngineStats
from hybridflow.rollout.native.parallel import TensorParallelGroup
from hybridflow.rollout.native.sessions import NativeRequestEngine
from hybridflow.rollout.native.spec import spec_from_config
from hybridflow.rollout.native.stages import PipelineStageGroup
from hybridflow.rollout.native.weights import Weights


class NativeRollout(Rollout):
    """Continuous-batching generation with the engine's own forward over a packed copy of the weights.

    model: a Llama / Qwen2 / Mistral causal LM from transformers; only its config and weights
    are read (the rollout keeps no reference to it, so the caller may drop it). dtype: the
    compute dtype, default the model's (the trainer loads the generator in `rollout.dtype`,
    bf16 by default). stop_token_ids: tokens that end a response, default the EOS ids that
    `HFRollout` uses; [] generates every response to full length (benchmarks).
    engine_config: the engine's batch limits (`actor_rollout_ref.rollout.native.*`).
    tp_group: the ranks that generate together, tensor-parallel (parallel.py); every rank of it must
    make the same calls with the same prompts. None: this rank generates alone with a whole copy.
    pp_group: the ranks whose pipeline stages hold the decoder layers between them (stages.py), each rank with its
    own tp_group; every rank of it makes the same calls too. None: this rank holds every layer.
    """

    load_casts = True  # Weights.load copies into the engine's tensors, casting

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        engine_config: NativeEngineConfig,
        dtype: torch.dtype | None = None,
        stop_token_ids: list[int] | None = None,
        tp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids, self.pad_token_id = stop_and_pad_ids(model.generation_config.eos_token_id, tokenizer)
        self.stop_token_ids = list(self.eos_token_ids if stop_token_ids is None else stop_token_ids)
        dtype = dtype or next(model.parameters()).dtype
        spec = spec_from_config(model.config)
        tp = TensorParallelGroup.of(model.config.model_type, tp_group)
        weights = Weights.from_model(model, spec, dtype, tp, PipelineStageGroup.of(pp_group))
        self.engine = Engine(weights, engine_config)
        self.adapters = engine_config.adapters
        self.requests = NativeRequestEngine(self.engine, self.stop_token_ids)

    @property
    def stats(self) -> EngineStats:
        """Counters of the last generation (prefills, decode steps, ...)."""
        return self.engine.stats

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """Same contract and layout as `HFRollout.generate_sequences` (see `Rollout`).

        Identical prompts (e.g. the n interleaved repeats of a GRPO group) are prefilled once.
        """
        return self.generate_partial(prompts, params, None)

    @torch.no_grad()
    def generate_partial(
        self, prompts: DataProto, params: SamplingParams, should_stop: Callable[[], bool] | None
    ) -> DataProto:
        """Partial rollout: rows with a ``prefix_length`` continue their ``responses`` (and
        ``rollout_log_probs``) after that many tokens, prefilling prompt and prefix under the weights held
        now; ``should_stop`` (asked after every decode step) ends the call early, and the ``interrupted``
        column marks the rows cut short (their response mask covers the tokens they have)."""
        if self._ranks() > 1 and should_stop is not None:
            raise NotImplementedError(
                "partial rollout generates on one rank: rollout.tensor_model_parallel_size=1 and "
                "rollout.pipeline_model_parallel_size=1"
            )
        prompt_ids = prompts.batch[INPUT_IDS]
        prompt_mask = prompts.batch[ATTENTION_MASK]
        token_lists = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]
        continuation = self._continuation(prompts) if PREFIX_LENGTH in prompts.batch.keys() else None
        responses, log_probs = self.engine.generate(
            token_lists,
            params,
            self.stop_token_ids,
            self.pad_token_id,
            continuation=continuation,
            should_stop=should_stop,
        )
        responses, log_probs = responses.to(prompt_ids.device), log_probs.to(prompt_ids.device)
        mask = response_mask_from(responses, self.stop_token_ids) if self.stop_token_ids else torch.ones_like(responses)
        interrupted = ~self.engine.finished.to(prompt_ids.device)
        if interrupted.any():  # a row cut short has only its first `lengths` tokens
            have = torch.arange(responses.shape[1], device=responses.device)[None, :] < self.engine.lengths[:, None]
            mask = torch.where(interrupted[:, None], have.long(), mask)
        batch = assemble_batch(
            prompt_ids, prompt_mask, responses, mask, log_probs, self.pad_token_id, self.stop_token_ids
        )
        if should_stop is not None or continuation is not None:
            batch[INTERRUPTED] = interrupted
        if params.record_routes:
            lengths = prompt_mask.sum(dim=1)
            batch[ROUTED_EXPERTS] = self.engine.routes.batch_rows(prompt_ids.shape[1], lengths, batch[ATTENTION_MASK])
        return DataProto.from_dict(batch, meta_info=dict(prompts.meta_info))

    @torch.no_grad()
    def generate_tokens(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_token_ids: list[int] | None = None,
        *,
        seeds: list[int] | None = None,
        streams: list[int] | None = None,
    ) -> list[TokenSample]:
        stops = self.eos_token_ids if stop_token_ids is None else list(stop_token_ids)
        tokens, log_probs = self.engine.generate(
            prompts, params, stops, self.pad_token_id, seeds=seeds, streams=streams
        )
        samples = []
        for row_tokens, row_log_probs in zip(tokens.tolist(), log_probs.tolist()):
            end = next((i + 1 for i, token in enumerate(row_tokens) if token in stops), None)
            length = end or len(row_tokens)
            samples.append(TokenSample(row_tokens[:length], row_log_probs[:length], stopped=end is not None))
        return samples

    @staticmethod
    def _continuation(prompts: DataProto) -> Continuation:
        lengths = prompts.batch[PREFIX_LENGTH].tolist()
        responses, log_probs = prompts.batch[RESPONSES], prompts.batch[ROLLOUT_LOG_PROBS]
        return Continuation(
            prefixes=[responses[i, :k].tolist() for i, k in enumerate(lengths)],
            prefix_log_probs=[log_probs[i, :k].tolist() for i, k in enumerate(lengths)],
            streams=list(range(len(lengths))),
        )

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite the engine's weights in place from (Hugging Face parameter name, tensor) pairs: the
        full tensor, or under tensor parallelism this rank's slice of it (`TensorParallelGroup.shard`).

        Takes the tensors one at a time (as the trainer gathers FSDP2 shards), casting to the
        engine's dtype and device; rotary buffers are ignored, unknown names raise KeyError.
        """
        self.engine.weights.load(named_tensors)

    def load_base_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A LoRA policy's base: served adapters go on top of the engine's own weights, so no copy is kept;
        merged ones need one (``Rollout.load_base_weights``)."""
        if self.adapters == "merged":
            super().load_base_weights(named_tensors)
        else:
            self.load_weights(named_tensors)

    def load_adapters(self, adapters: Iterable[tuple[str, torch.Tensor]], scaling: float) -> None:
        """Served: each adapted matrix applies scaling · (x A^T) B^T after its own product (linear.py);
        merged: W + scaling · B A written into the engine's weights (``Rollout.load_adapters``)."""
        if self.adapters == "merged":
            super().load_adapters(adapters, scaling)
        else:
            self.engine.weights.load_adapters(adapters, scaling)

    def request_engine(self) -> NativeRequestEngine:
        """Multi-turn generation on the same weights and KV cache (sessions.py); one rank only."""
        if self._ranks() > 1:
            raise NotImplementedError(
                "multi-turn rollout runs on one rank: set rollout.tensor_model_parallel_size=1 and "
                "rollout.pipeline_model_parallel_size=1"
            )
        return self.requests

    def _ranks(self) -> int:
        """The ranks generating together, tensor-parallel and in pipeline stages."""
        weights = self.engine.weights
        return weights.tp.size * weights.stages.size

    def release_cache(self) -> None:
        """Free the KV cache after generation; the next generation allocates it again."""
        self.engine.release_cache()
