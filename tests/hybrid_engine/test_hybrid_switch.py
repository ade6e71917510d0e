"""The hybrid engine's switch: weights reach the generator, offloaded state comes back intact."""

import pytest
import torch

from hybridflow.batch_keys import METRICS
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.policy import PolicyEngine
from hybridflow.hybrid_engine import HybridEngine, move_model, move_optimizer_state
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.hf import HFRollout
from hybridflow.rollout.native import NativeRollout
from hybridflow.trainer.setup.config import default_config

GREEDY = SamplingParams.greedy(max_new_tokens=6, seed=0)


def _trainer(config):
    torch.manual_seed(0)
    model = load_causal_lm(config.model.path, dtype=torch.float32)
    return PolicyEngine(TrainedModel.build(model, config.actor.optim, 10), config.actor)


def _step(engine: PolicyEngine, batch) -> dict[str, torch.Tensor]:
    data = batch.select(deepcopy=True)
    engine.update_policy(data, mini_batch_size=len(data), temperature=1.0, seed=0)
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    return [
        value.clone()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def test_generate_between_updates_syncs_weights_and_leaves_training_unchanged(
    tiny_path, rollout_batch, actor_config_factory
):
    config = actor_config_factory(
        tiny_path, 0.5, "actor_rollout_ref.actor.param_offload=true", "actor_rollout_ref.actor.optimizer_offload=true"
    )
    prompts = rollout_batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"], deepcopy=True)
    prompts.batch["input_ids"] = rollout_batch.batch["prompts"].clone()
    prompts.batch["attention_mask"] = rollout_batch.batch["attention_mask"][
        :, : prompts.batch["input_ids"].shape[1]
    ].clone()
    prompts.batch["position_ids"] = rollout_batch.batch["position_ids"][
        :, : prompts.batch["input_ids"].shape[1]
    ].clone()
    tokenizer = load_tokenizer(tiny_path)

    reference, switching = _trainer(config), _trainer(config)
    _step(reference, rollout_batch), _step(switching, rollout_batch)
    state_before = _optimizer_state(switching.trained.optimizer)
    engine_config = default_config().actor_rollout_ref.rollout.native
    initial = load_causal_lm(tiny_path, dtype=torch.float32)
    generator = NativeRollout(initial, tokenizer, engine_config=engine_config)
    before_sync = generator.generate_sequences(prompts, GREEDY).batch["responses"]
    hybrid = HybridEngine(
        switching.trained,
        generator,
        torch.device("cpu"),
        param_offload=True,
        optimizer_offload=True,
        dtype=torch.float32,
    )
    generated = hybrid.generate(prompts, GREEDY)

    expected = HFRollout(switching.model.eval(), tokenizer).generate_sequences(prompts, GREEDY).batch["responses"]
    assert not torch.equal(before_sync, expected)  # the update changed what the model says
    assert torch.equal(generated.batch["responses"], expected)  # the generator now has the trained weights
    metrics = generated.meta_info[METRICS]
    for key in ["timing_s/weight_sync", "timing_s/offload", "timing_s/release_cache", "timing_s/reload"]:
        assert metrics[key] >= 0, key
    assert metrics["perf/max_memory_gb"] == metrics["perf/max_memory_gb_generation"] > 0
    weight_mb = sum(p.numel() * 4 for p in switching.model.parameters()) / 2**20
    assert metrics["switch/generation_weights_mb"] == metrics["switch/training_params_mb"] == pytest.approx(weight_mb)
    assert metrics["switch/received_mb"] == metrics["switch/predicted_mb"] == 0.0  # one process: nothing moves
    assert metrics["perf/offloaded_gb"] == 0.0  # the training state already lives in CPU memory here
    for before, after in zip(state_before, _optimizer_state(switching.trained.optimizer), strict=True):
        assert torch.equal(before, after)
    second_reference, second = _step(reference, rollout_batch), _step(switching, rollout_batch)
    for name, weight in second_reference.items():
        assert torch.equal(second[name], weight), name


def _noting_dtypes(load_weights, dtypes: set):
    """``load_weights`` that adds the dtype of every weight it is given (not the buffers) to ``dtypes``."""

    def noted(named_tensors):
        for name, tensor in named_tensors:
            if name.endswith(".weight"):
                dtypes.add(tensor.dtype)
            yield name, tensor

    return lambda named_tensors: load_weights(noted(named_tensors))


def test_a_rollout_that_casts_as_it_loads_gets_the_weights_as_trained_and_the_same_bits(
    tiny_path, rollout_batch, actor_config_factory
):
    """The native engine casts as it copies (``load_casts``): a one-process trainer sends it its fp32 weights
    uncast, and a bf16 engine ends with the bits a cast first gives (the same log-probs, token for token)."""
    trainer = _trainer(actor_config_factory(tiny_path, 0.5))
    _step(trainer, rollout_batch)  # weights the generators do not start from
    prompts = rollout_batch.select(batch_keys=["attention_mask", "position_ids"], deepcopy=True)
    width = rollout_batch.batch["prompts"].shape[1]
    prompts.batch["input_ids"] = rollout_batch.batch["prompts"].clone()
    for key in ("attention_mask", "position_ids"):
        prompts.batch[key] = prompts.batch[key][:, :width].contiguous()
    outputs, received = {}, {}
    for casts in (True, False):
        generator = NativeRollout(
            load_causal_lm(tiny_path, dtype=torch.float32),
            load_tokenizer(tiny_path),
            engine_config=default_config().actor_rollout_ref.rollout.native,
            dtype=torch.bfloat16,
        )
        generator.load_casts = casts
        generator.load_weights = _noting_dtypes(generator.load_weights, received.setdefault(casts, set()))
        hybrid = HybridEngine(
            trainer.trained,
            generator,
            torch.device("cpu"),
            param_offload=False,
            optimizer_offload=False,
            dtype=torch.bfloat16,
        )
        outputs[casts] = hybrid.generate(prompts, GREEDY)
    assert received == {True: {torch.float32}, False: {torch.bfloat16}}
    for key in ("responses", "rollout_log_probs"):
        assert torch.equal(outputs[True].batch[key], outputs[False].batch[key]), key
    weight_mb = sum(p.numel() * 2 for p in trainer.model.parameters()) / 2**20  # as bf16, either way
    for output in outputs.values():
        assert output.meta_info[METRICS]["switch/generation_weights_mb"] == pytest.approx(weight_mb)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading moves state off a GPU; none here")
def test_offload_round_trip_on_gpu():
    device = torch.device("cuda", torch.cuda.current_device())  # the index named: cuda != cuda:0 for torch.device
    model = torch.nn.Linear(64, 32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 64, device=device)).sum().backward()
    optimizer.step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = _optimizer_state(optimizer)
    params_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert move_optimizer_state(optimizer, "cpu") >= 2 * params_bytes  # exp_avg and exp_avg_sq
    assert move_model(model, "cpu") == 2 * params_bytes  # weights and gradients
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert move_model(model, device) == 2 * params_bytes and move_optimizer_state(optimizer, device) >= 2 * params_bytes
    for name, p in model.named_parameters():
        assert p.device == device and torch.equal(p, weights[name])
    for before, after in zip(state, _optimizer_state(optimizer), strict=True):
        assert torch.equal(before.cpu(), after.cpu())
    optimizer.step()  # the state is usable where it came back to
