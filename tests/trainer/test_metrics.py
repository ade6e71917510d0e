import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.services.metrics import agent_metrics, log_prob_mismatch


def test_log_prob_mismatch_over_generated_tokens_only():
    real = torch.tensor([[1, 1, 0], [1, 1, 1]])  # response tokens (row 1's last is tool output the loop inserted)
    generated = torch.tensor([[1, 1, 0], [1, 1, 0]])
    batch = DataProto.from_dict(
        {
            "rollout_log_probs": torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, 0.0]]),
            "old_log_probs": torch.tensor([[-1.1, -1.5, 0.0], [-0.5, -0.7, -7.0]]),
            "responses": torch.zeros(2, 3, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(2, 2, dtype=torch.long), real], dim=1),  # 2 prompt tokens
            "generated_mask": generated,
            "response_mask": torch.zeros(2, 3, dtype=torch.long),  # a loss mask that took every token out
        }
    )
    # |diff| on the 4 generated tokens: 0.1, 0.5, 0, 0.2 -> mean 0.2, max 0.5 (the 9.0 gap is padding, the 7.0 a
    # tool token)
    metrics = log_prob_mismatch(batch)
    assert metrics["rollout/log_prob_diff_mean"] == pytest.approx(0.2) and metrics[
        "rollout/log_prob_diff_max"
    ] == pytest.approx(0.5)


def test_agent_metrics_by_hand():
    batch = DataProto.from_dict(
        {
            "num_turns": torch.tensor([1, 3, 2, 1]),
            "tool_calls": torch.tensor([0, 2, 1, 0]),
            "tool_errors": torch.tensor([0, 1, 0, 0]),
        },
        {"stop_reason": np.array(["no_tool_call", "length", "no_tool_call", "failed"], dtype=object)},
    )
    metrics = agent_metrics(batch)
    assert metrics["agent/num_turns/mean"] == pytest.approx(7 / 4) and metrics["agent/num_turns/max"] == 3
    assert metrics["agent/tool_calls_per_sample"] == pytest.approx(3 / 4)
    assert metrics["agent/tool_call_rate"] == pytest.approx(2 / 4)
    assert metrics["agent/tool_errors_per_sample"] == pytest.approx(1 / 4)
    assert metrics["agent/tool_error_rate"] == pytest.approx(1 / 3)
    assert metrics["agent/stop/no_tool_call"] == pytest.approx(0.5) and metrics["agent/stop/length"] == 0.25
    assert metrics["agent/stop/failed"] == 0.25
    assert agent_metrics(DataProto.from_dict({"responses": torch.zeros(2, 3)})) == {}
