"""The native engine's request API: turns that continue from the cache equal transformers on the whole context."""

import asyncio

import pytest
import torch
from rollout_helpers import QUESTIONS, engine_config, greedy, prompts_of, sampled

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from hybridflow.rollout.native import NativeRollout
from hybridflow.rollout.native.sessions import NativeRequestEngine


def _prompt_ids(tokenizer, questions):
    batch = prompts_of(tokenizer, questions).batch
    return [row[mask.bool()].tolist() for row, mask in zip(batch[INPUT_IDS], batch[ATTENTION_MASK])]


async def _serve(engine, params, conversations, max_len):
    """Run each conversation (request -> [(new tokens, max_new_tokens, delay before it), ...]) concurrently."""

    async def one(request, turns):
        outputs = []
        for new_tokens, budget, delay in turns:
            await asyncio.sleep(delay)  # a tool that takes a while: the others keep decoding
            outputs.append(await engine.generate(request, new_tokens, budget))
        engine.release(request)
        return outputs

    async with engine.serving(params, max_len=max_len, max_requests=len(conversations)):
        return await asyncio.gather(*(one(r, turns) for r, turns in conversations.items()))


def _hf_greedy(model, context: list[int], budget: int, stop_ids: list[int]) -> list[int]:
    tokens = []
    with torch.no_grad():
        for _ in range(budget):
            logits = model(torch.tensor([context + tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
            if tokens[-1] in stop_ids:
                break
    return tokens


def _hf_log_probs(model, ids: list[int], positions: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for each i in positions, from one forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    log_probs = logits.log_softmax(-1)
    return torch.stack([log_probs[i - 1, ids[i]] for i in positions])


@pytest.mark.parametrize("params", [greedy(10), sampled(seed=5, max_new_tokens=10)], ids=["greedy", "sampled"])
def test_one_turn_per_request_equals_the_batch_engine(tiny, params):
    """The same requests (with repeated prompts, as GRPO groups have) as one-turn conversations draw exactly
    the batch engine's tokens: same sampling streams, same numerics."""
    _, model, tokenizer = tiny
    questions = [q for q in QUESTIONS for _ in range(2)]
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config(min_shared_prefix=2))
    batch = rollout.generate_sequences(prompts_of(tokenizer, questions), params).batch
    prompts = _prompt_ids(tokenizer, questions)
    conversations = {r: [(prompt, params.max_new_tokens, 0.0)] for r, prompt in enumerate(prompts)}
    turns = asyncio.run(_serve(rollout.request_engine(), params, conversations, max_len=64))
    for r, (turn,) in enumerate(turns):
        n = int(batch[RESPONSE_MASK][r].sum())
        assert turn.tokens == batch[RESPONSES][r, :n].tolist()
        torch.testing.assert_close(torch.tensor(turn.log_probs), batch[ROLLOUT_LOG_PROBS][r, :n], rtol=1e-5, atol=1e-5)
        assert turn.stopped == (turn.tokens[-1] in rollout.stop_token_ids)
    common = next(i for i in range(64) if len({tuple(p[: i + 1]) for p in prompts}) > 1)
    assert rollout.request_engine().stats.shared_prefix_tokens == common > 0  # the template's start, computed once


@pytest.mark.parametrize("max_num_seqs", [2, 16])
@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "whole_rows"])
def test_turns_continue_from_the_cache_as_transformers_on_the_whole_context(tiny, max_num_seqs, ragged):
    """Three-turn conversations with inserted tokens between turns, tools of different durations, and (with 2
    slots) requests waiting for a slot: every turn is transformers' greedy continuation of the whole context,
    and the log-probs are those of one forward over the whole conversation."""
    _, model, tokenizer = tiny
    stop = [tokenizer.eos_token_id]
    prompts = _prompt_ids(tokenizer, QUESTIONS)
    inserted = [tokenizer.encode(text, add_special_tokens=False) for text in ("tool says 42", "ok", "x = 7 and y")]
    conversations = {
        r: [(prompt, 6, 0.0), (inserted[r % 3], 5, 0.002 * r), (inserted[(r + 1) % 3], 4, 0.001)]
        for r, prompt in enumerate(prompts)
    }
    config = engine_config(max_num_seqs=max_num_seqs, ragged_decode=ragged)
    engine = NativeRollout(model, tokenizer, engine_config=config).request_engine()
    results = asyncio.run(_serve(engine, greedy(), conversations, max_len=96))
    for r, turns in enumerate(results):
        context, generated_at = [], []
        for (new_tokens, budget, _), turn in zip(conversations[r], turns):
            context += new_tokens
            assert turn.tokens == _hf_greedy(model, context, budget, stop), (r, len(context))
            generated_at += range(len(context), len(context) + len(turn.tokens))
            context += turn.tokens
        log_probs = torch.tensor([lp for turn in turns for lp in turn.log_probs])
        torch.testing.assert_close(log_probs, _hf_log_probs(model, context, generated_at), rtol=1e-4, atol=1e-4)
    # ragged: decode read each conversation's real length in its own slot (rollout/native/ragged_attention.py)
    assert engine.ragged == ragged
    stats = engine.stats
    assert stats.turns == 3 * len(prompts)
    if ragged:
        assert stats.slot_moves == 0  # a request keeps its slot from its first turn to its release
    elif max_num_seqs == 2:
        assert stats.slot_moves > 0  # turns ended inside the decoding slots and were parked above


def test_a_later_turn_computes_only_the_appended_tokens(tiny):
    """Prefix reuse: the prefill work of a conversation is its prompt once plus what each turn appended (and the
    previous turn's last token, which decode had not yet cached); re-prefilling from scratch gives the same
    tokens for far more work."""
    _, model, tokenizer = tiny
    prompts = _prompt_ids(tokenizer, QUESTIONS)
    tool = tokenizer.encode("tool output here", add_special_tokens=False)
    conversations = {r: [(p, 5, 0.0), (tool, 5, 0.0), (tool, 5, 0.0)] for r, p in enumerate(prompts)}
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config())
    reuse = rollout.request_engine()
    scratch = NativeRequestEngine(rollout.engine, rollout.stop_token_ids, reuse_cache=False)
    outputs = {}
    for name, engine in (("reuse", reuse), ("scratch", scratch)):
        results = asyncio.run(_serve(engine, greedy(), conversations, max_len=96))
        outputs[name] = [[turn.tokens for turn in turns] for turns in results]
    assert outputs["reuse"] == outputs["scratch"]
    stopped_early = sum(t[-1] in rollout.stop_token_ids for turns in outputs["reuse"] for t in turns[:2])
    prompt_tokens = sum(len(p) for p in prompts) - (len(prompts) - 1) * reuse.stats.shared_prefix_tokens
    appended = 2 * len(prompts) * (len(tool) + 1)
    assert reuse.stats.prefill_tokens == prompt_tokens + appended, stopped_early
    contexts = sum(
        len(p)
        + (len(p) + sum(len(t) for t in turns[:1]) + len(tool))
        + (len(p) + sum(len(t) for t in turns[:2]) + 2 * len(tool))
        for p, turns in zip(prompts, outputs["scratch"])
    )
    assert scratch.stats.prefill_tokens >= contexts - 3 * (len(prompts) - 1) * scratch.stats.shared_prefix_tokens
    assert scratch.stats.prefill_tokens > 2 * reuse.stats.prefill_tokens


def test_a_sessions_time_is_split_into_its_phases(tiny):
    """Before the first step, in steps, between them (a tool's 50 ms, when nothing else could step) and after the
    last: the four add up to the serving block, and the tool's wait is counted between steps."""
    _, model, tokenizer = tiny
    prompts = _prompt_ids(tokenizer, QUESTIONS[:2])
    tool = tokenizer.encode("tool output", add_special_tokens=False)
    engine = NativeRollout(model, tokenizer, engine_config=engine_config()).request_engine()
    conversations = {r: [(p, 3, 0.0), (tool, 3, 0.05)] for r, p in enumerate(prompts)}

    async def timed():
        started = asyncio.get_running_loop().time()
        await _serve(engine, greedy(), conversations, max_len=96)
        return asyncio.get_running_loop().time() - started

    block = asyncio.run(timed())
    stats = engine.stats
    phases = [
        stats.seconds_to_first_step,
        stats.step_seconds,
        stats.between_steps_seconds,
        stats.after_last_step_seconds,
    ]
    assert all(p >= 0 for p in phases) and stats.step_seconds > 0 and stats.decode_steps > 0
    assert stats.between_steps_seconds >= 0.05  # both conversations' tools waited, none stepping
    assert sum(phases) <= block


def test_bad_calls_are_refused(tiny):
    _, model, tokenizer = tiny
    engine = NativeRollout(model, tokenizer, engine_config=engine_config()).request_engine()

    async def run():
        with pytest.raises(RuntimeError, match="serving"):
            await engine.generate(0, [1, 2], 3)
        async with engine.serving(greedy(), max_len=16, max_requests=1):
            with pytest.raises(ValueError, match="exceed the 16 positions"):
                await engine.generate(0, list(range(3, 13)), 8)
            with pytest.raises(ValueError, match="max_new_tokens >= 1"):
                await engine.generate(0, [3, 4], 0)

    asyncio.run(run())
