"""vLLM behind the Rollout interface, against transformers, the native engine and forward passes (fp32, tiny models)."""

import copy

import pytest
import torch
from lora_helpers import lora_model, randomise_adapters
from rollout_helpers import QUESTIONS, engine_config, greedy, perturbed, prompts_of, sampled

from hybridflow.batch_keys import RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS, TRUNCATED
from hybridflow.engine.lora import adapter_tensors, base_parameters, lora_scaling
from hybridflow.rollout.hf import HFRollout
from hybridflow.rollout.native import NativeRollout

pytestmark = pytest.mark.slow


def _forward_log_probs(model, out, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each response token under ``model``, from one forward over prompt + response."""
    prompt_len = out["prompts"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits[:, prompt_len - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _chosen(log_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return log_probs.gather(-1, tokens[..., None])[..., 0]


def test_greedy_equals_transformers_and_the_native_engine_token_for_token(tiny):
    model, tokenizer, rollout = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)  # different lengths, left-padded
    expected = HFRollout(model, tokenizer).generate_sequences(prompts, greedy(12)).batch
    native = (
        NativeRollout(model, tokenizer, engine_config=engine_config()).generate_sequences(prompts, greedy(12)).batch
    )
    got = rollout.generate_sequences(prompts, greedy(12)).batch
    assert set(got.keys()) == set(expected.keys())
    for key in expected.keys():
        if key != ROLLOUT_LOG_PROBS:
            assert torch.equal(got[key], expected[key]), key
            assert torch.equal(got[key], native[key]), key
    assert torch.allclose(got[ROLLOUT_LOG_PROBS], expected[ROLLOUT_LOG_PROBS], atol=1e-5)


def test_log_probs_match_a_forward_pass_greedy_and_at_a_temperature(tiny):
    model, tokenizer, rollout = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)
    for params in (greedy(10), sampled(seed=3, max_new_tokens=10, temperature=0.7)):
        out = rollout.generate_sequences(prompts, params).batch
        temperature = params.temperature if params.do_sample else 1.0
        expected = _chosen(_forward_log_probs(model, out, temperature), out[RESPONSES])
        mask = out[RESPONSE_MASK].bool()
        assert mask.sum() > 10
        # fp32 engine against fp32 transformers: within 1e-5 per token
        assert torch.allclose(out[ROLLOUT_LOG_PROBS][mask], expected[mask], atol=1e-5)
        assert (out[ROLLOUT_LOG_PROBS][~mask] == 0).all()


def test_top_k_log_probs_are_those_of_the_truncated_distribution(tiny):
    """With top-k on, vLLM reports log p over the k candidates (renormalised), as it samples them."""
    model, tokenizer, rollout = tiny
    prompts = prompts_of(tokenizer, QUESTIONS[:2])
    out = rollout.generate_sequences(prompts, sampled(seed=11, max_new_tokens=8, temperature=0.8, top_k=5)).batch
    scaled = _forward_log_probs(model, out, 0.8)
    top = scaled.topk(5, dim=-1)
    assert (top.indices == out[RESPONSES][..., None]).any(-1)[out[RESPONSE_MASK].bool()].all()  # drawn from the top 5
    expected = _chosen(scaled, out[RESPONSES]) - top.values.logsumexp(-1)
    mask = out[RESPONSE_MASK].bool()
    assert torch.allclose(out[ROLLOUT_LOG_PROBS][mask], expected[mask], atol=1e-5)


def test_each_request_samples_from_its_own_seed(tiny):
    """Same call seed: the same samples, whatever else is in the batch; another seed: other samples."""
    _, tokenizer, rollout = tiny
    prompts = prompts_of(tokenizer, [QUESTIONS[1]] * 4 + [QUESTIONS[2]] * 4)  # two groups of n = 4
    params = sampled(seed=7, max_new_tokens=10)
    first = rollout.generate_sequences(prompts, params).batch
    again = rollout.generate_sequences(prompts, params).batch
    assert torch.equal(first[RESPONSES], again[RESPONSES])
    assert len({tuple(row.tolist()) for row in first[RESPONSES][:4]}) > 1  # a group's samples differ
    other = rollout.generate_sequences(prompts, sampled(seed=8, max_new_tokens=10)).batch
    assert not torch.equal(first[RESPONSES], other[RESPONSES])
    # row 5 among other companions (rows 0-4 another prompt, rows 6-7 gone): the same sample
    mixed = prompts_of(tokenizer, [QUESTIONS[0]] * 5 + [QUESTIONS[2]])
    assert torch.equal(rollout.generate_sequences(mixed, params).batch[RESPONSES][5], first[RESPONSES][5])


def test_stop_tokens_end_responses_and_an_empty_list_generates_to_full_length(tiny):
    model, tokenizer, rollout = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)
    free = rollout.generate_sequences(prompts, greedy(12)).batch
    stop = int(free[RESPONSES][0, 2])  # the third greedy token of row 0 becomes a stop token
    saved = rollout.stop_token_ids
    try:
        rollout.stop_token_ids = [stop]
        out = rollout.generate_sequences(prompts, greedy(12)).batch
        rollout.stop_token_ids = []
        full = rollout.generate_sequences(prompts, greedy(12)).batch
    finally:
        rollout.stop_token_ids = saved
    for row in range(len(QUESTIONS)):  # each row stops at the first occurrence of the token, stop included
        length = int(free[RESPONSE_MASK][row].sum())
        hits = (free[RESPONSES][row, :length] == stop).nonzero()
        expected = int(hits[0, 0]) + 1 if len(hits) else length
        assert out[RESPONSE_MASK][row].tolist() == [1] * expected + [0] * (12 - expected), row
        assert torch.equal(out[RESPONSES][row, :expected], free[RESPONSES][row, :expected])
        assert bool(out[TRUNCATED][row]) == (expected == 12 and out[RESPONSES][row, -1] != stop)
    assert out[RESPONSE_MASK][0].sum() <= 3  # row 0 was cut
    assert full[RESPONSE_MASK].all() and full[TRUNCATED].all()


def test_after_load_weights_generation_follows_the_updated_model(tiny):
    """In place (the storage of vLLM's weights is kept), and the cached prompt prefixes of the old weights
    are not reused."""
    model, tokenizer, rollout = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)
    before = rollout.generate_sequences(prompts, greedy(10)).batch  # fills vLLM's prefix cache
    vllm_model = rollout.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    pointers = {name: param.data_ptr() for name, param in vllm_model.named_parameters()}
    changed = perturbed(model)
    try:
        rollout.load_weights([*changed.named_parameters(), *changed.named_buffers()])  # as the trainer yields them
        assert pointers == {name: param.data_ptr() for name, param in vllm_model.named_parameters()}
        expected = HFRollout(changed, tokenizer).generate_sequences(prompts, greedy(10)).batch
        got = rollout.generate_sequences(prompts, greedy(10)).batch
        assert not torch.allclose(got[ROLLOUT_LOG_PROBS], before[ROLLOUT_LOG_PROBS], atol=1e-2)
        assert torch.equal(got[RESPONSES], expected[RESPONSES])
        mask = got[RESPONSE_MASK].bool()
        assert torch.allclose(
            got[ROLLOUT_LOG_PROBS][mask], _chosen(_forward_log_probs(changed, got), got[RESPONSES])[mask], atol=1e-5
        )
    finally:
        rollout.load_weights(model.named_parameters())
    assert torch.equal(rollout.generate_sequences(prompts, greedy(10)).batch[RESPONSES], before[RESPONSES])


def test_release_cache_frees_the_kv_cache_until_the_next_generation(tiny):
    _, tokenizer, rollout = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)
    params = sampled(seed=2, max_new_tokens=10)
    before = rollout.generate_sequences(prompts, params).batch
    assert rollout.cache.held_bytes() == rollout.cache.nbytes == 2**30  # kv_cache_gb: 1.0
    rollout.release_cache()
    rollout.release_cache()  # idempotent
    assert rollout.cache.held_bytes() == 0
    after = rollout.generate_sequences(prompts, params).batch
    assert rollout.cache.held_bytes() == rollout.cache.nbytes
    assert torch.equal(after[RESPONSES], before[RESPONSES])
    assert torch.equal(after[ROLLOUT_LOG_PROBS], before[ROLLOUT_LOG_PROBS])


def test_a_lora_policy_is_merged_into_vllm_s_weights_and_new_adapters_replace_the_old(tiny):
    """vLLM reloads whole weights: the base is loaded once, then each set of adapters is merged from the copy of
    it kept on this side; generation follows peft's model each time."""
    model, tokenizer, rollout = tiny
    prompts = prompts_of(tokenizer, QUESTIONS)
    peft_model = lora_model(copy.deepcopy(model)).eval()
    try:
        rollout.load_base_weights([*base_parameters(peft_model), *peft_model.named_buffers()])
        for seed in (1, 2):
            randomise_adapters(peft_model, seed)
            rollout.load_adapters(adapter_tensors(peft_model), lora_scaling(peft_model))
            got = rollout.generate_sequences(prompts, greedy(10)).batch
            mask = got[RESPONSE_MASK].bool()
            expected = _chosen(_forward_log_probs(peft_model, got), got[RESPONSES])
            assert torch.allclose(got[ROLLOUT_LOG_PROBS][mask], expected[mask], atol=1e-4)
    finally:
        rollout.load_weights(model.named_parameters())
