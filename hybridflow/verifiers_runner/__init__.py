"""verifiers environments, run in a venv of their own: runner.py (and its in-process harness, hybridflow_chat.py)
is executed by that venv's Python and imports nothing of hybridflow; launch.py, imported by the run, finds that
Python and starts the runner. docs/environments.md is the user's guide."""
