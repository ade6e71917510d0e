"""What every run uses, whatever its trainer: checkpoints, trackers, the progress display, the step's timeline,
metrics of a step's data and of validation."""
