"""transformers' ``generate`` behind the ``Rollout`` interface (``rollout.name=hf``).

- rollout.py   HFRollout: generation on a whole (unsharded) copy of the policy
- backend.py   its registration as a backend
"""

from hybridflow.rollout.hf.rollout import HFRollout

__all__ = ["HFRollout"]
