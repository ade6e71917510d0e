"""Generation with transformers' ``generate`` on a full (unsharded) copy of the policy's weights."""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from hybridflow.algorithms import log_probs_from_logits
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import Rollout, SamplingParams, assemble_batch, response_mask_from


class HFRollout(Rollout):
    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase):
        self.model = model.eval()
        self.tokenizer = tokenizer
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(tokenizer.eos_token_id)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k if params.top_k > 0 else 0}
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
        prompt_ids = prompts.batch["input_ids"]
        prompt_mask = prompts.batch["attention_mask"]
        torch.manual_seed(params.seed)
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
        batch = assemble_batch(prompt_ids, prompt_mask, responses, mask, log_probs, self.pad_token_id)
        return DataProto.from_dict(batch, meta_info=dict(prompts.meta_info))
