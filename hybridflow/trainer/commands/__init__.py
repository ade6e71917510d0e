"""The driver's commands: ``hybridflow train`` (train.py), ``sft``, ``export``, ``measure``; each checks its
input, builds what the run needs and runs the step loop (or reads a run's files)."""
