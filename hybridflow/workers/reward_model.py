"""A learned reward model: a sequence classifier reading the conversation in its own chat template
(data/reward_text.py: the rendering ``hybridflow rm`` trains on), scored by the packed forward every pass runs."""

from __future__ import annotations

import torch

from hybridflow.batch_keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    RAW_PROMPT,
    RESPONSE_MASK,
    RESPONSES,
    RM_SCORES,
)
from hybridflow.controller import Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.data.reward_text import reward_model_text, scored_conversation
from hybridflow.engine.sequence_scores import batched_scores
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_reward_model, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.workers.config import RewardModelConfig
from hybridflow.workers.sharded_model import RoleMeshes, build_sharded

REWARD_MESH = "reward_model"  # its rows (RoleMeshes.rows): compute_rm_score splits them over dp


def last_token_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores placed at each response's last real token: (B, R), on ``response_mask``'s device."""
    device = response_mask.device
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=device)
    last = (response_mask.sum(dim=1) - 1).clamp(min=0)
    token_scores[torch.arange(len(scores), device=device), last] = scores.to(device, torch.float32)
    return token_scores * (response_mask.sum(dim=1, keepdim=True) > 0)


def text_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DataProto:
    """Right-padded token rows (B, L) in the training batch's layout, for the one packed forward every pass runs
    (engine/forward.py): a one-token "prompt" and the rest as the "response" (a score reads no labels)."""
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    columns = {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask, POSITION_IDS: position_ids}
    return DataProto.from_dict({**columns, RESPONSES: input_ids[:, 1:]})


class RewardModelWorker(Worker):
    """model_path: the reward model's directory; policy_model_path: the policy's (its tokenizer decodes); layout: its
    (dp, sp) over this group's ranks (the run plan's)."""

    def __init__(
        self, *, config: RewardModelConfig, model_path: str, policy_model_path: str, layout: LayoutShape, seed: int
    ):
        super().__init__()
        self.config = config
        self.policy_tokenizer = load_tokenizer(policy_model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        meshes = RoleMeshes.build(self.device, layout)
        self.register_dispatch_mesh(REWARD_MESH, meshes.rows)
        self.sp_group = meshes.sp_group
        self.model = build_sharded(load_reward_model, model_path, config.fsdp, self.device, seed, meshes.training)
        self.model.eval()

    def _conversations(self, data: DataProto) -> list[str]:
        responses = data.batch[RESPONSES]
        lengths = data.batch[RESPONSE_MASK].sum(dim=1)
        texts = []
        for i in range(len(data)):
            response = self.policy_tokenizer.decode(responses[i, : int(lengths[i])], skip_special_tokens=True)
            conversation = scored_conversation(list(data.non_tensor_batch[RAW_PROMPT][i]), response)
            texts.append(reward_model_text(self.tokenizer, conversation))
        return texts

    @register(dispatch_mode=mesh_compute_proto(REWARD_MESH))
    @torch.no_grad()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        if RAW_PROMPT not in data.non_tensor_batch:
            raise KeyError("the reward model needs the chat messages of each prompt in non-tensor key 'raw_prompt'")
        encoded = self.tokenizer(
            self._conversations(data),
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.config.max_length,
            add_special_tokens=False,
        )
        rows = text_rows(encoded["input_ids"], encoded["attention_mask"]).to(self.device)
        pad = self.model.config.get_text_config().pad_token_id
        micro_batch = self.config.micro_batch_size_per_gpu
        scores = batched_scores(self.model, rows, micro_batch, pad, remove_padding=True, sp_group=self.sp_group)
        rm_scores = last_token_scores(scores, data.batch[RESPONSE_MASK])
        return DataProto.from_dict({RM_SCORES: rm_scores})
