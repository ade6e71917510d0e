import numpy as np
import torch

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, PROMPTS, RESPONSES, ROUTED_EXPERTS, UID
from hybridflow.protocol import DataProto
from hybridflow.trainer.asynchronous.rollout_batches import concat_rollouts

PAD = 0


def rollout_batch(prompt_rows: list[list[int]], width: int, uid: str) -> DataProto:
    """Left-padded prompts of ``width`` followed by a 2-token response [7, 8]."""
    prompts = torch.tensor([[PAD] * (width - len(row)) + row for row in prompt_rows])
    prompt_mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in prompt_rows])[:, None]).long()
    responses = torch.tensor([[7, 8]] * len(prompt_rows))
    attention = torch.cat([prompt_mask, torch.ones_like(responses)], dim=1)
    return DataProto.from_dict(
        {
            PROMPTS: prompts,
            RESPONSES: responses,
            INPUT_IDS: torch.cat([prompts, responses], dim=1),
            ATTENTION_MASK: attention,
            POSITION_IDS: (attention.cumsum(dim=1) - 1).clamp(min=0),
        },
        non_tensors={UID: np.array([uid] * len(prompt_rows), dtype=object)},
    )


def test_concat_pads_narrow_prompts_on_the_left():
    wide = rollout_batch([[3, 4, 5]], width=3, uid="a")
    narrow = rollout_batch([[6]], width=1, uid="b")
    whole = concat_rollouts([wide, narrow], pad_token_id=PAD)
    assert whole.batch[INPUT_IDS].tolist() == [[3, 4, 5, 7, 8], [PAD, PAD, 6, 7, 8]]
    assert whole.batch[ATTENTION_MASK].tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert whole.batch[POSITION_IDS].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]  # unchanged on real tokens
    assert whole.batch[PROMPTS].tolist() == [[3, 4, 5], [PAD, PAD, 6]]
    assert list(whole.non_tensor_batch[UID]) == ["a", "b"]
    assert narrow.batch[INPUT_IDS].shape == (1, 3)  # the input batches are kept as they were


def test_concat_pads_the_routed_experts_of_narrow_prompts_with_none():
    """Routing replay's routes begin with the prompt too: (B, P+R, layers, k), padded with -1 (no route)."""
    wide, narrow = rollout_batch([[3, 4, 5]], width=3, uid="a"), rollout_batch([[6]], width=1, uid="b")
    for batch, first in ((wide, 10), (narrow, 20)):
        width = batch.batch[INPUT_IDS].shape[1]
        batch.batch[ROUTED_EXPERTS] = torch.arange(first, first + width * 2).view(1, width, 1, 2)
    routes = concat_rollouts([wide, narrow], pad_token_id=PAD).batch[ROUTED_EXPERTS]
    assert routes.shape == (2, 5, 1, 2)
    assert routes[1, :, 0].tolist() == [[-1, -1], [-1, -1], [20, 21], [22, 23], [24, 25]]
    assert routes[0, :, 0].tolist() == [[10 + 2 * i, 11 + 2 * i] for i in range(5)]
