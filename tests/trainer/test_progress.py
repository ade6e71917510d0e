import io

import pytest
from rich.console import Console

from hybridflow.trainer.services import progress as progress_module
from hybridflow.trainer.services.progress import RunProgress, format_seconds


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module, "monotonic", clock)
    return clock


def pipe():
    out = io.StringIO()
    return out, Console(file=out, width=100)  # not a terminal, as when output goes to a file or CI


def test_format_seconds():
    assert format_seconds(0) == "0:00:00"
    assert format_seconds(3725.2) == "1:02:05"


def test_quiet_when_not_a_terminal(clock):
    out, console = pipe()
    with RunProgress(10, console=console, plain_every_s=60) as progress:
        assert not progress.enabled
        with progress.stage("validation") as stage:
            stage.advance()
        for step in range(1, 4):
            with progress.stage("generation"):
                clock.now += 10
            progress.step_done(step, {"critic/score/mean": 0.1 * step})
        assert out.getvalue() == ""  # 30 s in: no line yet, no bars ever
        clock.now += 40
        progress.step_done(4, {"critic/score/mean": 0.5, "val/score/mean": 0.25})
    lines = out.getvalue().splitlines()
    # steps 2..4 took 60 s after step 1 ended: 20 s a step, 6 steps left
    assert lines == ["step 4/10 (40%) | elapsed 0:01:10 | eta 0:02:00 | reward 0.5 | val 0.25"]


def test_quiet_prints_last_step_and_can_be_silent(clock):
    out, console = pipe()
    progress = RunProgress(2, console=console)
    progress.step_done(1, {})
    progress.step_done(2, {"critic/score/mean": 1.0})
    progress.close()
    assert out.getvalue().splitlines() == ["step 2/2 (100%) | elapsed 0:00:00 | eta 0:00:00 | reward 1"]
    out, console = pipe()
    silent = RunProgress(2, console=console, plain_every_s=None)
    silent.step_done(2, {"critic/score/mean": 1.0})
    silent.close()
    assert out.getvalue() == ""


def test_eta_counts_only_this_process_steps(clock):
    progress = RunProgress(100, enabled=False, start_step=50, console=pipe()[1])
    assert progress.eta_seconds() is None
    clock.now += 20
    progress.step_done(52)
    assert progress.eta_seconds() == pytest.approx(10 * 48)


def test_eta_leaves_out_validation_before_training_and_warm_up(clock):
    progress = RunProgress(10, enabled=False, console=pipe()[1])
    clock.now += 100  # validation at step 0 and a slow first step
    progress.step_done(1)
    assert progress.eta_seconds() == pytest.approx(100 * 9)
    clock.now += 10
    progress.step_done(2)
    clock.now += 20
    progress.step_done(3)
    assert progress.eta_seconds() == pytest.approx(15 * 7)  # (10 + 20) / 2 per step since step 1


def test_bars_on_a_terminal(clock):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    progress = RunProgress(8, console=console)
    assert progress.enabled
    with progress.stage("generation", total=4) as stage:
        stage.advance(2)
        progress.refresh()
        assert "generation" in out.getvalue() and "2/4" in out.getvalue()
    clock.now += 30
    progress.step_done(1, {"critic/score/mean": 0.375})
    progress.refresh()
    progress.close()
    progress.close()
    text = out.getvalue()
    assert "run" in text and "1/8" in text and "reward 0.375" in text and "eta 0:03:30" in text
