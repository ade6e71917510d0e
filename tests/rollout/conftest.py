"""The rollout tests. Importing this file puts tests/rollout on the import path, so that the
backends' test folders share rollout_helpers.py (prompts and sampling parameters)."""
