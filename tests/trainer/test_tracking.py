import io
import json
import sys
import types

import pytest
from rich.console import Console

from hybridflow.trainer.services import tracking
from hybridflow.trainer.services.tracking import KNOWN_LOGGERS, LoggerNotInstalledError, Tracking, check_loggers

CONFIG = {
    "trainer": {"project_name": "proj", "experiment_name": "exp", "logger": ["console"]},
    "algorithm": {"gamma": 1.0},
}
STEP1 = {
    "critic/score/mean": 0.25,
    "actor/pg_loss": -0.5,
    "val/arith/pass@2": 0.75,
    "note": "text",
    "bad": float("nan"),
}


def test_known_loggers():
    assert KNOWN_LOGGERS == ("console", "jsonl", "tensorboard", "wandb", "mlflow")
    with pytest.raises(ValueError, match="unknown logger 'csv'"):
        check_loggers(["console", "csv"])


def test_console_and_jsonl(tmp_path):
    out = io.StringIO()
    with Tracking(["console", "jsonl"], tmp_path, console=Console(file=out, width=80)) as track:
        track.log({"critic/score/mean": 0.5, "timing_s/step": 2.0}, step=0)
        track.log(STEP1, step=1)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, "critic/score/mean": 0.5, "timing_s/step": 2.0}
    assert rows[1]["step"] == 1 and rows[1]["actor/pg_loss"] == -0.5 and rows[1]["bad"] == "nan"
    text = out.getvalue()
    assert "step 1" in text and "critic/score/mean" in text and "0.25" in text


def test_old_two_argument_call(tmp_path):
    track = Tracking(["jsonl"], tmp_path)
    track.log({"a": 1.0}, step=3)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "a": 1.0}
    track.finish()
    track.finish()  # twice is fine


def test_tensorboard_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking(["tensorboard"], tmp_path, CONFIG) as track:
        track.log({"critic/score/mean": 0.5}, step=0)
        track.log(STEP1, step=1)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert {"critic/score/mean", "actor/pg_loss", "val/arith/pass@2"} <= set(scalars)
    assert "note" not in scalars and "bad" not in scalars
    assert [(e.step, e.value) for e in accumulator.Scalars("critic/score/mean")] == [(0, 0.5), (1, 0.25)]


@pytest.mark.parametrize(
    "name, command",
    [("wandb", "pip install wandb"), ("mlflow", "pip install mlflow"), ("tensorboard", "pip install tensorboard")],
)
def test_missing_package_is_a_clear_early_error(tmp_path, monkeypatch, name, command):
    for module in tracking.OPTIONAL_PACKAGES[name][0]:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if not installed
    with pytest.raises(LoggerNotInstalledError, match=command) as error:
        check_loggers(["console", name])
    assert f"'{name}'" in str(error.value) and "trainer.logger" in str(error.value)
    with pytest.raises(LoggerNotInstalledError, match=command):
        Tracking(["jsonl", name], tmp_path, CONFIG)
    with pytest.raises(LoggerNotInstalledError, match=command):  # also when only the import fails (spec found)
        tracking._import_for(name)


class FakeWandbRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


def test_wandb_offline_run(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: runs.append(FakeWandbRun(**kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with Tracking(["wandb"], tmp_path, CONFIG) as track:
        track.log(STEP1, step=1)
    (run,) = runs
    assert run.init == {"project": "proj", "name": "exp", "dir": str(tmp_path), "config": CONFIG, "mode": "offline"}
    assert run.logged == [(1, {"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "val/arith/pass@2": 0.75})]
    assert run.finished


def test_mlflow_local_store(tmp_path, monkeypatch):
    calls = []

    class FakeClient:
        def __init__(self, tracking_uri):
            calls.append(("uri", tracking_uri))

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name, artifact_location):
            assert artifact_location == (tmp_path / "mlruns" / "artifacts").resolve().as_uri()
            calls.append(("experiment", name))
            return "7"

        def create_run(self, experiment_id, run_name):
            calls.append(("run", experiment_id, run_name))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))

        def log_batch(self, run_id, metrics=(), params=()):
            calls.append(("batch", run_id, list(metrics), list(params)))

        def set_terminated(self, run_id):
            calls.append(("end", run_id))

    mlflow = types.ModuleType("mlflow")
    mlflow.MlflowClient = FakeClient
    entities = types.ModuleType("mlflow.entities")
    entities.Metric = lambda key, value, timestamp, step: (key, value, step)
    entities.Param = lambda key, value: (key, value)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.setitem(sys.modules, "mlflow.entities", entities)
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: object())
    with Tracking(["mlflow"], tmp_path, CONFIG) as track:
        track.log(STEP1, step=1)
    assert calls[0] == ("uri", f"sqlite:///{(tmp_path / 'mlruns' / 'mlflow.db').resolve()}")
    assert calls[1:3] == [("experiment", "proj"), ("run", "7", "exp")]
    assert ("algorithm.gamma", "1.0") in calls[3][3]
    assert calls[4] == (
        "batch",
        "r1",
        [("critic/score/mean", 0.25, 1), ("actor/pg_loss", -0.5, 1), ("val/arith/pass_2", 0.75, 1)],
        [],
    )
    assert calls[-1] == ("end", "r1")
