"""The pinned tinker SDK's own clients against a real ``hybridflow serve`` (tiny model, fp32): one test per
endpoint and loss, every number checked against an independent computation (the base model and peft's own
loading of the saved adapter in this process) or against an identity the loss must satisfy."""

import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from service_helpers import KEY, MODEL
from tinker import types

from hybridflow.engine.adapter_slots import ADAPTER_FILE
from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    n = len(tokens) - 1
    w = np.ones(n, dtype=np.float32) if weights is None else np.asarray(weights, dtype=np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64), "weights": w},
    )


def batch(seed: int, count: int = 7) -> list[types.Datum]:
    g = np.random.default_rng(seed)
    out = []
    for length in g.integers(5, 14, size=count):
        tokens = g.integers(3, 500, size=length).tolist()
        out.append(datum(tokens, (g.random(length - 1) > 0.25).astype(np.float32).tolist()))
    return out


def with_inputs(data: list[types.Datum], **columns: list[np.ndarray]) -> list[types.Datum]:
    """The datums with target_tokens and the given per-datum columns as their loss inputs."""
    out = []
    for i, d in enumerate(data):
        inputs = {"target_tokens": d.loss_fn_inputs["target_tokens"].to_numpy()}
        inputs.update({name: np.asarray(values[i], dtype=np.float32) for name, values in columns.items()})
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return out


def logprobs_of(result) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in result.loss_fn_outputs]


def forward(tc, data) -> list[np.ndarray]:
    return logprobs_of(tc.forward(data, "cross_entropy").result())


def adam(lr: float = 1e-2) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)


def local_logprobs(data: list[types.Datum], adapter_dir: Path | None = None) -> list[np.ndarray]:
    """Independently: the base model (and peft's loading of a saved adapter) in this process."""
    model = load_causal_lm(resolve_model_path(MODEL), dtype=torch.float32)
    if adapter_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
    out = []
    with torch.no_grad():
        for d in data:
            tokens = torch.tensor([d.model_input.to_ints()])
            targets = torch.as_tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
            logits = model(input_ids=tokens).logits[0].float()
            out.append(torch.log_softmax(logits, -1)[torch.arange(len(targets)), targets].numpy())
    return out


def saved_dir(storage: Path, uri: str) -> Path:
    model_id, kind, name = uri.removeprefix("tinker://").split("/")
    return storage / model_id / kind / name


def assert_close(got: list[np.ndarray], want: list[np.ndarray], atol: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=atol)


def test_capabilities_model_info_and_tokenizer(service, clients):
    sc = clients()
    caps = sc.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [MODEL]
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    info = tc.get_info()
    assert (info.model_name, info.lora_rank, info.is_lora) == (MODEL, 4, True)
    assert tc.get_tokenizer().encode("a b c") == load_tokenizer(resolve_model_path(MODEL)).encode("a b c")
    assert httpx.get(f"{service.url}/api/v1/healthz").json() == {"status": "ok"}


def test_cross_entropy_in_out_of_order_chunks_matches_the_base_model_and_peft(service, clients):
    """Seven datums go as three chunks (limits.max_datums_per_request=3) sent together, the first last."""
    sc = clients()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    data = batch(seed=1)
    result = tc.forward_backward(data, "cross_entropy").result()
    first = logprobs_of(result)
    assert_close(first, local_logprobs(data), atol=1e-4)  # B = 0 at the start: the base model's log-probs
    expected_loss = -sum(float((lp * d.loss_fn_inputs["weights"].to_numpy()).sum()) for lp, d in zip(first, data))
    assert result.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    for o, lp, d in zip(result.loss_fn_outputs, first, data):
        np.testing.assert_allclose(
            o["elementwise_loss"].to_numpy(), -lp * d.loss_fn_inputs["weights"].to_numpy(), atol=1e-6
        )
    tc.optim_step(adam()).result()
    path = tc.save_weights_for_sampler("after-one-step").result().path
    after = forward(tc, data)
    assert not np.allclose(np.concatenate(after), np.concatenate(first), atol=1e-4)
    assert_close(after, local_logprobs(data, saved_dir(service.storage, path)), atol=1e-4)
    saved = load_file(str(saved_dir(service.storage, path) / ADAPTER_FILE))
    assert saved["base_model.model.lm_head.lora_B.weight"].abs().max() > 0  # train_unembed, the SDK's default


def test_the_parts_an_adapter_trains_are_the_client_s_choice(service, clients):
    sc = clients()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=3, train_mlp=False, train_unembed=False)
    tc = tc.result()
    tc.forward_backward(batch(seed=1), "cross_entropy").result()
    tc.optim_step(adam()).result()
    saved = load_file(str(saved_dir(service.storage, tc.save_weights_for_sampler("attn").result().path) / ADAPTER_FILE))
    assert saved and all(".self_attn." in name for name in saved)


def test_forward_adds_no_gradient(service, clients):
    tc = clients().create_lora_training_client(base_model=MODEL, rank=4, seed=4).result()
    data = batch(seed=2)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam()).result()  # B != 0 from here on, so a gradient would move every adapter
    before = forward(tc, data)
    tc.optim_step(adam()).result()  # nothing accumulated since the last step: nothing moves
    assert_close(forward(tc, data), before, atol=0)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam()).result()
    assert not np.allclose(np.concatenate(forward(tc, data)), np.concatenate(before), atol=1e-4)


def test_importance_sampling_at_ratio_one_steps_as_cross_entropy(service, clients):
    """d/dθ of -exp(lp - lp_sampler)·A at lp = lp_sampler is -A·dlp: the cross-entropy gradient with weights A."""
    sc = clients()
    data = batch(seed=3)
    weights = [d.loss_fn_inputs["weights"].to_numpy() for d in data]
    by_ce = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    by_is = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    for _ in range(2):
        by_ce.forward_backward(data, "cross_entropy").result()
        sampler_logprobs = forward(by_is, data)
        result = by_is.forward_backward(
            with_inputs(data, logprobs=sampler_logprobs, advantages=weights), "importance_sampling"
        ).result()
        assert result.metrics["loss:sum"] == pytest.approx(-sum(float(w.sum()) for w in weights), rel=1e-5)
        by_ce.optim_step(adam()).result()
        by_is.optim_step(adam()).result()
    assert_close(forward(by_is, data), forward(by_ce, data), atol=1e-5)


def test_a_custom_loss_computed_by_the_sdk_steps_as_the_built_in_one(service, clients):
    """forward_backward_custom: the SDK runs forward, differentiates the loss itself, sends the gradient back as a
    cross_entropy surrogate; the weighted NLL written as a custom loss steps as cross_entropy does."""
    sc = clients()
    data = batch(seed=9)
    built_in = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=13).result()
    custom = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=13).result()

    def weighted_nll(data, logprobs_list):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list))
        return loss, {"weighted_nll": float(loss.detach())}

    for _ in range(2):
        expected = built_in.forward_backward(data, "cross_entropy").result()
        got = custom.forward_backward_custom(data, weighted_nll).result()
        assert got.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
        built_in.optim_step(adam()).result()
        custom.optim_step(adam()).result()
    assert_close(forward(custom, data), forward(built_in, data), atol=1e-5)


def test_ppo_clipped_tokens_pass_no_gradient_and_the_clip_is_a_setting(service, clients):
    """The optimizer step reports the gradient norm of what was accumulated: zero when every token is clipped."""
    sc = clients()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=6).result()
    data = batch(seed=4)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam()).result()
    current = forward(tc, data)
    advantages = [np.ones_like(lp) for lp in current]
    doubled = with_inputs(data, logprobs=[lp - math.log(2.0) for lp in current], advantages=advantages)
    result = tc.forward_backward(doubled, "ppo").result()  # ratio 2 > 1.2 with A > 0: every token clipped
    tokens = sum(len(lp) for lp in current)
    assert result.metrics["loss:sum"] == pytest.approx(-1.2 * tokens, rel=1e-5)
    assert tc.optim_step(adam(0.0)).result().metrics["grad_norm:mean"] == 0.0  # lr 0: the weights stay for below
    wide = tc.forward_backward(doubled, "ppo", loss_fn_config={"clip_high_threshold": 3.0}).result()
    assert wide.metrics["loss:sum"] == pytest.approx(-2.0 * tokens, rel=1e-5)
    assert tc.optim_step(adam(0.0)).result().metrics["grad_norm:mean"] > 0.0


def test_sampling_seeds_stops_logprobs_and_prompt_logprobs(service, clients):
    sc = clients()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    tc.forward_backward(batch(seed=5), "cross_entropy").result()
    tc.optim_step(adam(5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 17, 33, 41])

    def sample(seed: int, **params):
        settings = types.SamplingParams(max_tokens=12, seed=seed, temperature=1.0, **params)
        return sampler.sample(prompt, num_samples=3, sampling_params=settings).result()

    first, again, other = sample(11), sample(11), sample(12)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert [s.tokens for s in first.sequences] != [s.tokens for s in other.sequences]
    settings = [types.SamplingParams(max_tokens=12, seed=seed, temperature=1.0) for seed in (12, 11)]
    together = [sampler.sample(prompt, num_samples=3, sampling_params=p) for p in settings]  # may run batched
    assert [s.tokens for s in together[1].result().sequences] == [s.tokens for s in first.sequences]
    assert [s.tokens for s in together[0].result().sequences] == [s.tokens for s in other.sequences]
    assert len({s.sequence_id for s in first.sequences}) == 3
    for s in first.sequences:  # the sampler's log-probs are the trainer's (fp32 both)
        tokens = prompt.to_ints() + s.tokens
        trainer = forward(tc, [datum(tokens)])[0][-len(s.tokens) :]
        np.testing.assert_allclose(s.logprobs, trainer, atol=1e-4)
    tokens = first.sequences[0].tokens
    cut = 4
    stopped = sample(11, stop=[tokens[cut]]).sequences[0]
    end = tokens.index(tokens[cut]) + 1
    assert (stopped.tokens, stopped.stop_reason) == (tokens[:end], "stop")
    tokenizer = load_tokenizer(resolve_model_path(MODEL))
    at = next(i for i in range(2, len(tokens)) if tokenizer.decode(tokens[i : i + 1]).strip())  # a visible token
    text = tokenizer.decode(tokens[at : at + 1]).strip()
    by_string = sample(11, stop=[text]).sequences[0]
    assert by_string.stop_reason == "stop" and text in tokenizer.decode(by_string.tokens)
    assert by_string.tokens == tokens[: len(by_string.tokens)] and len(by_string.tokens) <= at + 1
    scored = types.ModelInput.from_ints(prompt.to_ints() + tokens)
    prompt_logprobs = sampler.compute_logprobs(scored).result()
    assert prompt_logprobs[0] is None
    np.testing.assert_allclose(prompt_logprobs[1:], forward(tc, [datum(scored.to_ints())])[0], atol=1e-5)
    base = sc.create_sampling_client(base_model=MODEL).result()
    base_logprobs = base.compute_logprobs(scored).result()
    np.testing.assert_allclose(base_logprobs[1:], local_logprobs([datum(scored.to_ints())])[0], atol=1e-4)
    greedy = base.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0))
    sequences = greedy.result().sequences
    assert sequences[0].tokens == sequences[1].tokens


def test_saved_states_load_with_and_without_the_optimizer(service, clients):
    sc = clients()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=3, seed=8, train_mlp=False).result()
    first, second, held_out = batch(seed=6), batch(seed=7), batch(seed=8, count=4)
    tc.forward_backward(first, "cross_entropy").result()
    tc.optim_step(adam()).result()
    at_save = forward(tc, held_out)
    path = tc.save_state("after-first").result().path
    tc.forward_backward(second, "cross_entropy").result()
    tc.optim_step(adam()).result()
    original = forward(tc, held_out)
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 3
    assert_close(forward(resumed, held_out), at_save, atol=1e-6)
    resumed.forward_backward(second, "cross_entropy").result()
    resumed.optim_step(adam()).result()
    assert_close(forward(resumed, held_out), original, atol=1e-5)
    fresh = sc.create_training_client_from_state(path).result()  # weights only: AdamW starts again
    fresh.forward_backward(second, "cross_entropy").result()
    fresh.optim_step(adam()).result()
    assert not np.allclose(np.concatenate(forward(fresh, held_out)), np.concatenate(original), atol=1e-5)
    tc.load_state(path).result()  # into the existing model, in its turn
    assert_close(forward(tc, held_out), at_save, atol=1e-6)
    sampler_path = tc.save_weights_for_sampler("for-sampling").result().path
    assert sampler_path.endswith("/sampler_weights/for-sampling")
    sampled = (
        sc.create_sampling_client(model_path=sampler_path)
        .result()
        .compute_logprobs(types.ModelInput.from_ints([4, 9, 12]))
    )
    np.testing.assert_allclose(sampled.result()[1:], forward(tc, [datum([4, 9, 12])])[0], atol=1e-5)


def test_two_sessions_interleaved_train_as_each_would_alone(service, clients):
    a, b = clients(), clients()
    model_a = a.create_lora_training_client(base_model=MODEL, rank=4, seed=9).result()
    model_b = b.create_lora_training_client(base_model=MODEL, rank=2, seed=10).result()
    futures = []
    for step in range(2):  # submitted without waiting: the service runs them interleaved
        futures += [model_a.forward_backward(batch(seed=20 + step), "cross_entropy")]
        futures += [model_b.forward_backward(batch(seed=30 + step), "cross_entropy")]
        futures += [model_a.optim_step(adam()), model_b.optim_step(adam())]
    for future in futures:
        future.result()
    held_out = batch(seed=40, count=3)
    for seed, rank, data_seed, trained in ((9, 4, 20, model_a), (10, 2, 30, model_b)):
        alone = a.create_lora_training_client(base_model=MODEL, rank=rank, seed=seed).result()
        for step in range(2):
            alone.forward_backward(batch(seed=data_seed + step), "cross_entropy").result()
            alone.optim_step(adam()).result()
        assert_close(forward(trained, held_out), forward(alone, held_out), atol=1e-6)


def test_a_slow_result_is_polled_across_short_waits(service, clients):
    """service.poll_timeout_s=0.5: a retrieve_future call answers "try again" while the result is not ready. The
    polled call waits in the worker's queue behind another generation (other settings: not batched with it), each of
    8 samples x 1,000 tokens, several seconds together even on a fast host (8 x 400 took under 0.5 s on one)."""
    sc = clients()
    session = sc.holder.get_session_id()
    headers = {"X-API-Key": KEY}
    sampler = sc.create_sampling_client(base_model=MODEL).result()._sampling_session_id

    def asample(seq_id: int, max_tokens: int) -> dict:
        body = {
            "sampling_session_id": sampler,
            "seq_id": seq_id,
            "num_samples": 8,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": 1, "stop": []},
        }
        return httpx.post(f"{service.url}/api/v1/asample", json=body, headers=headers).json()

    ahead = asample(0, 999)
    future = asample(1, 1000)
    assert len(ahead["sample_sequence_ids"]) == len(future["sample_sequence_ids"]) == 8 and session
    answers = []
    while True:
        response = httpx.post(
            f"{service.url}/api/v1/retrieve_future",
            json={"request_id": future["request_id"]},
            headers={**headers, "Accept": "application/x-protobuf"},
            timeout=30,
        )
        if response.headers["content-type"].startswith("application/x-protobuf"):
            break
        answers.append(response.json()["type"])
    assert answers and set(answers) == {"try_again"}
    from tinker.proto.response_conv import deserialize_sample_response

    sequences = deserialize_sample_response(response.content).sequences
    assert [len(s.tokens) for s in sequences] == [1000] * 8  # stop=[]: no EOS stop, every response full length


def test_a_save_under_a_used_name_is_what_new_samplers_read(service, clients):
    """A loop that saves its sampler weights under one name ("latest") samples from the last save: the worker's
    copy of a path's weights (for prompt log-probs, and the rollout engine's for sampling) goes with a new save."""
    sc = clients()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=13).result()
    prompt = types.ModelInput.from_ints([5, 17, 99, 230, 41, 7, 300])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])

    def read(path: str) -> tuple[list[float], list[float]]:
        """What a new sampling client of ``path`` gives: the prompt's log-probs and a greedy sample's."""
        sampler = sc.create_sampling_client(model_path=path).result()
        sample = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
        return sampler.compute_logprobs(prompt).result()[1:], sample.logprobs

    def step(seed: int) -> list[float]:
        tc.forward_backward(batch(seed=seed), "cross_entropy").result()
        tc.optim_step(adam()).result()
        return forward(tc, [datum(prompt.to_ints())])[0]  # the training model's log-probs of the prompt

    step(70)
    latest = tc.save_weights_for_sampler("latest").result().path
    before = read(latest)
    now = step(71)
    assert tc.save_weights_for_sampler("latest").result().path == latest
    again = read(latest)
    fresh = read(tc.save_weights_for_sampler("fresh").result().path)
    assert not np.allclose(before[0], now, atol=1e-4)  # the second step moved the weights
    np.testing.assert_allclose(again[0], now, atol=1e-5)
    np.testing.assert_allclose(again[0], fresh[0], atol=1e-6)
    np.testing.assert_allclose(again[1], fresh[1], atol=1e-6)  # the sample: the rollout's weights are the new ones


def test_a_batch_the_sdk_chunks_by_its_rules_is_taken_whole(service, clients):
    """The service tells the SDK the bytes of a chunk so that its chunks stay within limits.max_tokens_per_request
    (1,500 here): seven datums of 600 tokens, three to a chunk by the datum bound alone (1,800 tokens), go as chunks
    the service takes."""
    tc = clients().create_lora_training_client(base_model=MODEL, rank=2, seed=14).result()
    g = np.random.default_rng(15)
    data = [datum(g.integers(3, 500, size=601).tolist()) for _ in range(7)]
    result = tc.forward(data, "cross_entropy").result()
    assert [len(lp) for lp in logprobs_of(result)] == [600] * 7
