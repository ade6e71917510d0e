"""Training modes: the facts in trainer/setup/modes.py, the parts registered by the loop (trainer/loop/mode_parts.py),
each import pointing down the layers: every built-in mode has its parts, and a mode's parts need the mode."""

import dataclasses

import pytest

from hybridflow.trainer.loop import mode_parts
from hybridflow.trainer.setup import modes


def test_every_mode_has_its_parts():
    assert set(modes.mode_names()) == {"sync", "one_step_off", "fully_async"}
    for name in modes.mode_names():
        assert callable(mode_parts.mode_parts(name))


def test_parts_need_their_mode_and_a_mode_needs_its_parts(monkeypatch):
    with pytest.raises(ValueError, match="unknown training mode 'no_such_mode'"):
        mode_parts.register_mode_parts("no_such_mode")
    monkeypatch.setattr(modes, "_MODES", dict(modes._MODES))  # a new mode for this test only
    modes.register_training_mode(dataclasses.replace(modes.training_mode("sync"), name="made_up"))
    with pytest.raises(ValueError, match="training mode 'made_up' has no parts registered"):
        mode_parts.mode_parts("made_up")
    monkeypatch.setattr(mode_parts, "PARTS", dict(mode_parts.PARTS))

    @mode_parts.register_mode_parts("made_up")
    def made_up_parts(inputs):
        return "source", "weights"

    assert mode_parts.mode_parts("made_up")(None) == ("source", "weights")
    with pytest.raises(ValueError, match="already registered"):
        mode_parts.register_mode_parts("made_up")(made_up_parts)
