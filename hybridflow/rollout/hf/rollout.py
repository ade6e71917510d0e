"""Generation with transformers' ``generate`` on a full (unsharded) copy of the policy's weights."""

from __future__ import annotations

import gc
from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from hybridflow.algorithms import log_probs_from_logits
from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, ROUTED_EXPERTS
from hybridflow.models.routing import recording_routes, routers
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import Rollout, SamplingParams, assemble_batch, response_mask_from, stop_and_pad_ids


class HFRollout(Rollout):
    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids, self.pad_token_id = stop_and_pad_ids(model.generation_config.eos_token_id, tokenizer)

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else 0,
        }
        return GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=params.do_sample,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            **(sampling if params.do_sample else {}),
        )

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        prompt_ids = prompts.batch[INPUT_IDS]
        prompt_mask = prompts.batch[ATTENTION_MASK]
        if params.record_routes and not routers(self.model):
            raise ValueError("record_routes: the model has no mixture-of-experts layers")
        torch.manual_seed(params.seed)
        with recording_routes(self.model) if params.record_routes else nullcontext() as recorder:
            out = self.model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=self._generation_config(params)
            )
        generated = out.sequences[:, prompt_ids.shape[1] :]  # (B, R') with R' <= max_new_tokens
        logits = torch.stack(out.logits, dim=1).float()  # (B, R', V), raw (before sampling warpers)
        if params.do_sample and params.temperature != 1.0:
            logits = logits / params.temperature
        log_probs = log_probs_from_logits(logits, generated)
        pad = params.max_new_tokens - generated.shape[1]
        responses = nn.functional.pad(generated, (0, pad), value=self.pad_token_id)
        log_probs = nn.functional.pad(log_probs, (0, pad), value=0.0)
        mask = response_mask_from(responses, self.eos_token_ids)
        mask[:, generated.shape[1] :] = 0
        batch = assemble_batch(
            prompt_ids, prompt_mask, responses, mask, log_probs, self.pad_token_id, self.eos_token_ids
        )
        if recorder is not None:
            batch[ROUTED_EXPERTS] = generation_routes(recorder.routes(), batch[ATTENTION_MASK], prompt_ids.shape[1])
        return DataProto.from_dict(batch, meta_info=dict(prompts.meta_info))

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        target = self.model.state_dict()
        for name, tensor in named_tensors:
            if name in target:
                target[name].copy_(tensor)

    def release_cache(self) -> None:
        """``generate`` builds its cache per call; collecting drops what the last call left."""
        gc.collect()


def generation_routes(calls: list[torch.Tensor], attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """The experts of each position of ``generate``'s rows, (B, P+R, L, k), from its forwards' routes: the first
    runs the (left-padded) prompts, (B·P, L, k); each later one the previous step's token of every row, (B, L, k).
    The last token is never fed back, and padding has no route: -1 there."""
    rows = attention_mask.shape[0]
    first, steps = calls[0], calls[1:]
    routes = torch.full((*attention_mask.shape, *first.shape[1:]), -1, dtype=first.dtype)
    routes[:, :prompt_length] = first.view(rows, prompt_length, *first.shape[1:])
    for step, call in enumerate(steps):
        routes[:, prompt_length + step] = call
    return routes.masked_fill(attention_mask[:, :, None, None] == 0, -1)
