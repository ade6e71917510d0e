"""Partial rollout on the native engine: a call stopped between two decode steps keeps the tokens it has, and
continuing its rows gives what one uninterrupted call gives (same weights) or what the new weights generate from
that prefix (after a weight push)."""

import torch
from rollout_helpers import engine_config, greedy, perturbed, prompts_of, sampled

from hybridflow.batch_keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    INTERRUPTED,
    POSITION_IDS,
    PREFIX_LENGTH,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
)
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rollout.native import NativeRollout

QUESTIONS = ["Hi", "Add 17 and 25", "What is 2 + 3?", "Tell me a story about numbers"]
R = 12


def after(decode_steps: int):
    """should_stop that says stop after ``decode_steps`` decode steps."""
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) >= decode_steps

    return should_stop


def continuation_of(prompts: DataProto, cut: DataProto) -> DataProto:
    return DataProto.from_dict(
        {
            INPUT_IDS: prompts.batch[INPUT_IDS],
            ATTENTION_MASK: prompts.batch[ATTENTION_MASK],
            POSITION_IDS: prompts.batch[POSITION_IDS],
            RESPONSES: cut.batch[RESPONSES],
            ROLLOUT_LOG_PROBS: cut.batch[ROLLOUT_LOG_PROBS],
            PREFIX_LENGTH: cut.batch[RESPONSE_MASK].sum(dim=1),
        }
    )


def rollout_of(model, tokenizer):
    # stop_token_ids=[]: every response runs to R tokens, so every row is still running when the call stops
    return NativeRollout(model, tokenizer, engine_config=engine_config(), stop_token_ids=[])


def test_a_stopped_call_continued_with_the_same_weights_is_one_uninterrupted_call():
    model, tokenizer = load_causal_lm("tiny-llama", dtype=torch.float32), load_tokenizer("tiny-llama")
    rollout = rollout_of(model, tokenizer)
    prompts, params = prompts_of(tokenizer, QUESTIONS), sampled(seed=3, max_new_tokens=R)
    whole = rollout.generate_sequences(prompts, params)

    cut = rollout.generate_partial(prompts, params, after(4))
    assert cut.batch[INTERRUPTED].all()
    assert cut.batch[RESPONSE_MASK].sum(dim=1).tolist() == [5] * len(QUESTIONS)  # the prefill's token + 4 decodes
    assert torch.equal(cut.batch[RESPONSES][:, :5], whole.batch[RESPONSES][:, :5])

    continued = rollout.generate_partial(continuation_of(prompts, cut), params, None)
    assert not continued.batch[INTERRUPTED].any()
    assert torch.equal(continued.batch[RESPONSES], whole.batch[RESPONSES])
    assert torch.allclose(continued.batch[ROLLOUT_LOG_PROBS], whole.batch[ROLLOUT_LOG_PROBS], atol=1e-5)
    assert torch.equal(continued.batch[INPUT_IDS], whole.batch[INPUT_IDS])


def test_after_new_weights_the_continuation_is_what_they_generate_from_the_prefix():
    model, tokenizer = load_causal_lm("tiny-llama", dtype=torch.float32), load_tokenizer("tiny-llama")
    new_model = perturbed(model)
    rollout = rollout_of(model, tokenizer)
    prompts = prompts_of(tokenizer, QUESTIONS)
    cut = rollout.generate_partial(prompts, greedy(R), after(3))
    k = 4
    assert cut.batch[RESPONSE_MASK].sum(dim=1).tolist() == [k] * len(QUESTIONS)

    rollout.load_weights(new_model.named_parameters())  # the push
    continued = rollout.generate_partial(continuation_of(prompts, cut), greedy(R), None)
    assert torch.equal(continued.batch[RESPONSES][:, :k], cut.batch[RESPONSES][:, :k])  # the prefix is kept
    assert torch.equal(continued.batch[ROLLOUT_LOG_PROBS][:, :k], cut.batch[ROLLOUT_LOG_PROBS][:, :k])

    # the new weights alone, from each prompt followed by its prefix
    fresh = rollout_of(new_model, tokenizer)
    for row in range(len(QUESTIONS)):
        mask = prompts.batch[ATTENTION_MASK][row].bool()
        ids = torch.cat([prompts.batch[INPUT_IDS][row][mask], cut.batch[RESPONSES][row, :k]])[None, :]
        start = DataProto.from_dict(
            {INPUT_IDS: ids, ATTENTION_MASK: torch.ones_like(ids), POSITION_IDS: torch.arange(ids.shape[1])[None, :]}
        )
        want = fresh.generate_sequences(start, greedy(R - k))
        assert torch.equal(continued.batch[RESPONSES][row, k:], want.batch[RESPONSES][0])
        assert torch.allclose(continued.batch[ROLLOUT_LOG_PROBS][row, k:], want.batch[ROLLOUT_LOG_PROBS][0], atol=1e-5)
    # and the old weights would have gone on differently: the push changed the samples
    old = rollout_of(model, tokenizer).generate_sequences(prompts, greedy(R))
    assert not torch.equal(old.batch[RESPONSES], continued.batch[RESPONSES])


def test_requests_still_waiting_for_a_slot_when_stopped_have_no_tokens():
    model, tokenizer = load_causal_lm("tiny-llama", dtype=torch.float32), load_tokenizer("tiny-llama")
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config(max_num_seqs=2), stop_token_ids=[])
    prompts = prompts_of(tokenizer, QUESTIONS)
    cut = rollout.generate_partial(prompts, greedy(R), after(2))
    assert cut.batch[INTERRUPTED].all()
    assert cut.batch[RESPONSE_MASK].sum(dim=1).tolist() == [3, 3, 0, 0]  # two ran 1 + 2 tokens, two never started
    continued = rollout.generate_partial(continuation_of(prompts, cut), greedy(R), None)
    whole = rollout.generate_sequences(prompts, greedy(R))
    assert torch.equal(continued.batch[RESPONSES], whole.batch[RESPONSES])


def test_a_call_kept_with_its_cache_resumes_where_it_stopped():
    """The other way to continue ("KV kept"): the engine keeps the stopped call and its KV cache; resumed with
    the same weights it is the uninterrupted call."""
    model, tokenizer = load_causal_lm("tiny-llama", dtype=torch.float32), load_tokenizer("tiny-llama")
    rollout = rollout_of(model, tokenizer)
    prompts, params = prompts_of(tokenizer, QUESTIONS), sampled(seed=5, max_new_tokens=R)
    whole = rollout.generate_sequences(prompts, params)
    engine = rollout.engine
    token_lists = [
        row[mask.bool()].tolist() for row, mask in zip(prompts.batch[INPUT_IDS], prompts.batch[ATTENTION_MASK])
    ]
    tokens, _ = engine.generate(token_lists, params, [], rollout.pad_token_id, should_stop=after(3), keep_on_stop=True)
    assert (~engine.finished).all() and engine.lengths.tolist() == [4] * len(QUESTIONS)
    tokens, log_probs = engine.resume()
    assert engine.finished.all() and engine.paused is None
    assert torch.equal(tokens, whole.batch[RESPONSES])
    assert torch.allclose(log_probs, whole.batch[ROLLOUT_LOG_PROBS], atol=1e-5)
