"""A rollout backend is one registration: its factory, capabilities and checks reach the trainer through it."""

import pytest
import torch

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout import backend as registry
from hybridflow.rollout.backend import RolloutBackend, register_rollout_backend, rollout_backend, rollout_backends
from hybridflow.rollout.build import build_rollout
from hybridflow.rollout.config import RolloutConfig
from hybridflow.rollout.hf import HFRollout
from hybridflow.rollout.native import NativeEngineConfig
from hybridflow.rollout.vllm import VllmEngineConfig
from hybridflow.trainer.setup.check_config import check_config
from hybridflow.trainer.setup.config import ConfigError, load_config
from hybridflow.validation import InvalidSetting


class CountingRollout(HFRollout):
    built = 0

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        CountingRollout.built += 1


def _refuse_big_models(run):
    if run.model_config.num_hidden_layers > 1:
        raise InvalidSetting("name", f"counting takes one layer, {run.model_name} has more", "use a one-layer model")


@pytest.fixture
def counting_backend():
    """A backend of the test's own, registered as a user would, and taken out again afterwards."""
    backend = register_rollout_backend(
        RolloutBackend(
            name="counting",
            summary="transformers' generate, counting its instances",
            build=lambda model, tokenizer, settings, tp_group: CountingRollout(model, tokenizer),
            check=_refuse_big_models,
        )
    )
    yield backend
    registry._BACKENDS.pop("counting")


def test_the_built_in_backends_describe_themselves():
    backends = rollout_backends()
    assert {"native", "vllm", "hf"} <= set(backends)
    assert backends["native"].settings is NativeEngineConfig and backends["native"].tensor_parallel
    assert backends["vllm"].settings is VllmEngineConfig and backends["vllm"].check is not None
    assert backends["hf"].settings is None and not backends["hf"].request_api
    assert [name for name, b in backends.items() if b.request_api] == ["native", "vllm"]


def test_the_rollout_config_has_a_section_per_backend_with_settings():
    rollout = load_config().actor_rollout_ref.rollout
    assert isinstance(rollout, RolloutConfig)
    assert isinstance(rollout.native, NativeEngineConfig) and isinstance(rollout.vllm, VllmEngineConfig)
    assert rollout.backend_settings() is rollout.native
    assert not hasattr(rollout, "hf")


def test_a_registered_backend_is_usable_by_name(counting_backend, arithmetic_files):
    config = load_config(["actor_rollout_ref.rollout.name=counting"])
    assert config.actor_rollout_ref.rollout.backend_settings() is None
    model, tokenizer = load_causal_lm("tiny-llama", dtype=torch.float32), load_tokenizer("tiny-llama")
    before = CountingRollout.built
    rollout = build_rollout(model, tokenizer, config.actor_rollout_ref.rollout)
    assert isinstance(rollout, CountingRollout) and CountingRollout.built == before + 1
    train, test = arithmetic_files
    files = [f"data.train_files=[{train}]", f"data.val_files=[{test}]", "actor_rollout_ref.rollout.name=counting"]
    with pytest.raises(ConfigError, match="counting takes one layer, tiny-llama has more") as caught:
        check_config(load_config(files))  # the backend's own check, with the key it names
    assert caught.value.key == "actor_rollout_ref.rollout.name"


def test_capabilities_are_read_from_the_registration(counting_backend):
    with pytest.raises(ConfigError, match="counting has no such API") as caught:
        load_config(["actor_rollout_ref.rollout.name=counting", "actor_rollout_ref.rollout.multi_turn.enable=true"])
    assert caught.value.key == "actor_rollout_ref.rollout.name" and "['native', 'vllm']" in str(caught.value)


def test_a_name_is_registered_once_and_settings_only_before_the_config_is_composed(counting_backend):
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_backend(counting_backend)
    late = RolloutBackend(name="late", summary="", build=counting_backend.build, settings=NativeEngineConfig)
    with pytest.raises(RuntimeError, match="register it before hybridflow.rollout.config is imported"):
        register_rollout_backend(late)
    assert "late" not in rollout_backends()
    with pytest.raises(KeyError, match="unknown rollout backend 'late'; known: counting, hf, native, vllm"):
        rollout_backend("late")
