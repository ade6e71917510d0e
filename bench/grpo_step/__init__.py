"""Helpers of bench/grpo_step.py: the TRL-side script (run in bench/.trl-venv) and the report."""
