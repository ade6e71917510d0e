"""The driver side: the run's config and checks, the run plan, placement, the RL fit loop, checkpoints, metrics."""
