"""Fixtures of the reward tests: the tiny tokenizer (loaded once) and a rollout-batch builder."""

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from hybridflow.models import load_tokenizer

    return load_tokenizer("tiny-llama")


def make_batch(tokenizer, responses, sources, truths, width=8):
    """A rollout batch whose responses are `text + <eos>`, right-padded to `width`.

    A response given as a list of ids is used as is (for an empty response).
    """
    pad = tokenizer.pad_token_id
    rows, masks = [], []
    for response in responses:
        if not isinstance(response, list):
            response = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = response
        assert len(ids) <= width
        rows.append(ids + [pad] * (width - len(ids)))
        masks.append([1] * len(ids) + [0] * (width - len(ids)))
    responses_t = torch.tensor(rows)
    prompts = torch.full((len(rows), 3), pad)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses_t,
            "input_ids": torch.cat([prompts, responses_t], dim=1),
            "attention_mask": torch.cat([torch.zeros_like(prompts), torch.tensor(masks)], dim=1),
            "response_mask": torch.tensor(masks),
        },
        non_tensors={
            "data_source": np.array(sources, dtype=object),
            "reward_model": [{"ground_truth": t, "style": "rule"} for t in truths],
            "extra_info": [{"tag": i} for i in range(len(rows))],
            "uid": [str(i) for i in range(len(rows))],
        },
    )


@pytest.fixture(name="make_batch")
def make_batch_fixture():
    return make_batch
