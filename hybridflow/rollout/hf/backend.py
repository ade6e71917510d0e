"""transformers' ``generate`` as a generation backend (``rollout.name=hf``): the reference the engines are
tested against."""

from __future__ import annotations

from hybridflow.rollout.backend import RolloutBackend, register_rollout_backend


def _build(model, tokenizer, settings: None, tp_group):
    from hybridflow.rollout.hf.rollout import HFRollout

    return HFRollout(model, tokenizer)


HF = register_rollout_backend(
    RolloutBackend(
        name="hf", summary="transformers' generate on a whole copy of the weights", build=_build, records_routes=True
    )
)
