import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.metrics import log_prob_mismatch


def test_log_prob_mismatch_over_generated_tokens_only():
    generated = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = DataProto.from_dict(
        {
            "rollout_log_probs": torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]]),
            "old_log_probs": torch.tensor([[-1.1, -1.5, 0.0], [-0.5, -0.7, -0.5]]),
            "responses": torch.zeros(2, 3, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(2, 2, dtype=torch.long), generated], dim=1),  # 2 prompt tokens
            "response_mask": torch.zeros(2, 3, dtype=torch.long),  # a loss mask that took every token out
        }
    )
    # |diff| on the 5 masked-in tokens: 0.1, 0.5, 0, 0.2, 0 -> mean 0.16, max 0.5 (the 9.0 gap is padding)
    metrics = log_prob_mismatch(batch)
    assert (
        abs(metrics["rollout/log_prob_diff_mean"] - 0.16) < 1e-6
        and abs(metrics["rollout/log_prob_diff_max"] - 0.5) < 1e-6
    )
