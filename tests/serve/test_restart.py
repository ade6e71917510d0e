"""Saved states outlive the service: a run saved under one service process loads, with its AdamW state, into a
new session of the next process on the same storage, and goes on exactly as it would have."""

import numpy as np
import pytest
from service_helpers import MODEL, client, running_service
from test_conformance import adam, batch, datum, forward

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def test_a_saved_state_survives_a_restart_of_the_service(tmp_path):
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
        sc.close("success").result(timeout=30)
