"""The reward manager's settings built by keyword, for tests."""

from hybridflow.reward import RewardConfig
from hybridflow.reward.shaping import OverlongBufferConfig

# tolerates every failure: the tests of failure handling see what the manager scores, not the stop
TOLERANT = RewardConfig(
    max_failure_rate=1.0,
    num_examine=0,
    overlong_buffer=OverlongBufferConfig(enable=False, len=16, penalty_factor=1.0),
    tool_reward_coef=1.0,
    turn_level=False,
)
