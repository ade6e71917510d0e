"""The driver side, in five parts, each importing only those below it (pyproject.toml's contract):

commands       hybridflow train, sft, dpo, rm, export, measure, distill-data
loop           the one step loop and its trainers (RL with its training modes' parts, SFT, DPO, the reward model)
setup          the run's config, checks, run plan, roles, placement, modes, run directory
asynchronous   the rollouter, staleness, partial rollout
services       checkpoints, tracking, progress, the step's timeline, metrics
"""
