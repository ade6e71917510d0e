"""Long generations do not break the native engine: 4,000 tokens per response (several thousand, the lengths that
Ulysses trains on), sampled, on a tiny model whose positions reach 8,192. Every response runs to its full length
(no stop token), its log-probs equal one independent forward over the whole sequence, and the same rows come out of
the trainer's packed pass (engine/forward.py), the one training reads them with."""

import torch
from rollout_helpers import QUESTIONS, engine_config, prompts_of, response_logits, sampled, token_log_probs

from hybridflow.batch_keys import ROLLOUT_LOG_PROBS
from hybridflow.engine.forward import response_log_probs
from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.rollout.native import NativeRollout

LENGTH = 4000


def test_responses_of_four_thousand_tokens_keep_their_log_probs():
    path = str(resolve_model_path("tiny-llama", max_position_embeddings=8192))
    model, tokenizer = load_causal_lm(path, dtype=torch.float32).eval(), load_tokenizer(path)
    prompts = prompts_of(tokenizer, QUESTIONS[:2])
    rollout = NativeRollout(model, tokenizer, engine_config=engine_config(), stop_token_ids=[])
    out = rollout.generate_sequences(prompts, sampled(seed=3, max_new_tokens=LENGTH))
    batch = out.batch
    assert batch["responses"].shape == (2, LENGTH) and bool(batch["response_mask"].all())
    assert len(set(batch["responses"][0].tolist())) > 50  # a varied sample, not one token repeated
    expected = token_log_probs(response_logits(model, batch, prompts.batch["input_ids"].shape[1]), batch["responses"])
    with torch.no_grad():
        packed, _ = response_log_probs(model, out, remove_padding=True)
    torch.testing.assert_close(batch[ROLLOUT_LOG_PROBS], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed, expected, atol=1e-4, rtol=1e-4)
