"""The reward manager's settings built by keyword, for tests."""

from hybridflow.reward import RewardConfig

# tolerates every failure: the tests of failure handling see what the manager scores, not the stop
TOLERANT = RewardConfig(max_failure_rate=1.0, num_examine=0)
