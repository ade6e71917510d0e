"""trainer.rollout_data_dir: a trained batch's rows written as records (trainer/services/rollout_data.py), the
padding gone and every per-token float32 value read back exactly."""

import numpy as np
import torch

from hybridflow.batch_keys import (
    ADVANTAGES,
    ATTENTION_MASK,
    DATA_SOURCE,
    INPUT_IDS,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    RESPONSES,
    TOKEN_LEVEL_SCORES,
    TRUNCATED,
    UID,
)
from hybridflow.models import load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.trainer.services.rollout_data import batch_records, read_rollout_data, write_rollout_data

PAD = 0


def test_a_batch_is_written_row_by_row_without_its_padding_and_read_back_exactly(tmp_path):
    tokenizer = load_tokenizer("tiny-llama")
    # row 0: prompt [5, 6] (one pad on the left), response [7, 8, 9] (the last token tool output, not trained)
    # row 1: prompt [10, 11, 12], response [13] (two pads on the right)
    input_ids = torch.tensor([[PAD, 5, 6, 7, 8, 9], [10, 11, 12, 13, PAD, PAD]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    advantages = torch.tensor([[0.1, -0.2, 1 / 3], [2.5, 0.0, 0.0]], dtype=torch.float32)
    old = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    scores = torch.tensor([[0.0, 0.0, 0.75], [1.0, 0.0, 0.0]])
    batch = DataProto.from_dict(
        tensors={
            INPUT_IDS: input_ids,
            ATTENTION_MASK: attention,
            RESPONSES: input_ids[:, 3:],
            RESPONSE_MASK: torch.tensor([[1, 1, 0], [1, 0, 0]]),
            ADVANTAGES: advantages,
            OLD_LOG_PROBS: old,
            TOKEN_LEVEL_SCORES: scores,
            TRUNCATED: torch.tensor([True, False]),
        },
        non_tensors={UID: np.array(["a", "b"], dtype=object), DATA_SOURCE: np.array(["t", "t"], dtype=object)},
    )
    write_rollout_data(tmp_path, 7, batch_records(batch, tokenizer, 7))
    first, second = read_rollout_data(tmp_path, 7)
    assert (first["prompt_ids"], first["response_ids"], first["response_mask"]) == ([5, 6], [7, 8, 9], [1, 1, 0])
    assert (second["prompt_ids"], second["response_ids"], second["response_mask"]) == ([10, 11, 12], [13], [1])
    assert (first["uid"], second["uid"], first["step"], first["data_source"]) == ("a", "b", 7, "t")
    assert (first["score"], second["score"], first["truncated"], second["truncated"]) == (0.75, 1.0, True, False)
    assert first["response"] == tokenizer.decode([7, 8, 9]) and second["prompt"] == tokenizer.decode([10, 11, 12])
    assert torch.equal(torch.tensor(first[ADVANTAGES], dtype=torch.float32), advantages[0])  # float32, exactly
    assert torch.equal(torch.tensor(second[OLD_LOG_PROBS], dtype=torch.float32), old[1, :1])
    assert "values" not in first and first["reward"] is None  # columns the step did not compute are left out
    assert not list(tmp_path.glob("*.tmp"))
