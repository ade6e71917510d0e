"""Saved states outlive the service: a run saved under one service process loads, with its AdamW state, into a
new session of the next process on the same storage, and goes on exactly as it would have. And a service whose
worker process is gone says so to the requests waiting on it and stops, with the reason."""

import httpx
import numpy as np
import psutil
import pytest
import tinker
from service_helpers import MODEL, client, running_service
from test_conformance import adam, batch, datum, forward

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


def worker_process(service) -> psutil.Process:
    """The service's worker: the Ray actor process among the service's descendants."""
    descendants = psutil.Process(service.process.pid).children(recursive=True)
    workers = [p for p in descendants if p.cmdline() and p.cmdline()[0].startswith("ray::WorkerHost")]
    assert len(workers) == 1, [p.cmdline()[:1] for p in descendants]
    return workers[0]


def test_a_saved_state_survives_a_restart_and_a_lost_worker_stops_the_service(tmp_path):
    storage = tmp_path / "storage"
    with running_service(storage, tmp_path / "first.log") as service:
        sc = client(service)
        model = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=31).result()
        model.forward_backward(batch(seed=60), "cross_entropy").result()
        model.optim_step(adam()).result()
        state = model.save_state("before-restart").result().path
        sampler = model.save_weights_for_sampler("sampler-before-restart").result().path
        model.forward_backward(batch(seed=61), "cross_entropy").result()
        model.optim_step(adam()).result()
        held_out = batch(seed=62, count=3)
        expected = forward(model, held_out)
        sc.close("success").result(timeout=30)
    assert service.process.returncode == 0
    assert not any((storage / ".scratch").iterdir())  # nothing half-written left behind
    with running_service(storage, tmp_path / "second.log") as service:
        sc = client(service)
        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        resumed.forward_backward(batch(seed=61), "cross_entropy").result()
        resumed.optim_step(adam()).result()
        for got, want in zip(forward(resumed, held_out), expected):
            np.testing.assert_allclose(got, want, atol=1e-6)
        prompt = [3, 14, 15, 92]
        logprobs = sc.create_sampling_client(model_path=sampler).result().compute_logprobs(datum(prompt).model_input)
        assert len(logprobs.result()) == 3 and all(np.isfinite(logprobs.result()[1:]))
        worker_process(service).kill()  # as the kernel's or Ray's out-of-memory killer would
        with pytest.raises(tinker.RequestFailedError, match="worker is gone"):
            resumed.forward(batch(seed=63), "cross_entropy").result()
        health = httpx.get(f"{service.url}/api/v1/healthz", timeout=5)
        assert health.status_code == 503 and "start it again" in health.json()["error"]
        assert service.process.wait(timeout=60) == 1
        sc.holder.close()  # no service to end the session with: the SDK's heartbeat stops here, not at exit
    assert "hybridflow serve: stopped: the service's worker is gone" in (tmp_path / "second.log").read_text()
