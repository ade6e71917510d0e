"""The asynchronous machinery below the loop: the rollouter thread that keeps a rollout pool generating into a
queue, the staleness rule that bounds it, partial rollout's continued samples, and joining rollouts generated
in separate calls."""
