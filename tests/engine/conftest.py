"""Fixtures of the engine tests that need Ray (the shared batch and configs are in tests/conftest.py)."""

import pytest
import ray

from hybridflow.controller import start_ray


@pytest.fixture(scope="module")
def local_ray():
    started = start_ray(num_cpus=8)
    yield
    if started:
        ray.shutdown()
