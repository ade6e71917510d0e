"""The transformers-generate rollout, in process: layout, masking, log-probs, padding, seeding."""

import pytest
import torch

from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams, response_mask_from
from hybridflow.rollout.hf import HFRollout


@pytest.fixture(scope="module")
def rollout():
    torch.manual_seed(0)
    return HFRollout(load_causal_lm("tiny-llama", dtype=torch.float32), load_tokenizer("tiny-llama"))


def prompts_of(tokenizer, questions: list[str]) -> DataProto:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    positions = (encoded["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "position_ids": positions}
    )


GREEDY = SamplingParams(do_sample=False, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=6, seed=0)


def test_response_mask_keeps_tokens_up_to_the_first_eos():
    responses = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    # eos = 2: row 0 keeps 5, 6, 2; row 1 never stops; row 2 is only the eos.
    expected = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert response_mask_from(responses, [2]).tolist() == expected


def test_batch_layout_and_log_probs_match_a_forward_pass(rollout):
    prompts = prompts_of(rollout.tokenizer, ["What is 2 + 3?", "Add 17 and 25, then tell me the result please."])
    out = rollout.generate_sequences(prompts, GREEDY)
    b = out.batch
    prompt_length = prompts.batch["input_ids"].shape[1]
    assert b["responses"].shape == (2, 6) and b["input_ids"].shape == (2, prompt_length + 6)
    assert torch.equal(b["input_ids"][:, :prompt_length], prompts.batch["input_ids"])
    assert torch.equal(b["attention_mask"][:, prompt_length:], b["response_mask"])
    with torch.no_grad():
        logits = rollout.model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    expected = (
        torch.log_softmax(logits[:, prompt_length - 1 : -1].float(), dim=-1)
        .gather(-1, b["responses"].unsqueeze(-1))
        .squeeze(-1)
    )
    mask = b["response_mask"].bool()
    assert torch.allclose(b["rollout_log_probs"][mask], expected[mask], atol=1e-4)
    # greedy picks the argmax of the same logits
    assert torch.equal(b["responses"][mask], logits[:, prompt_length - 1 : -1].argmax(-1)[mask])


def test_left_padded_batch_generates_what_each_prompt_does_alone(rollout):
    questions = ["Hi", "What is the sum of 12 and 30 and 4?"]
    together = rollout.generate_sequences(prompts_of(rollout.tokenizer, questions), GREEDY).batch["responses"]
    for i, question in enumerate(questions):
        alone = rollout.generate_sequences(prompts_of(rollout.tokenizer, [question]), GREEDY).batch["responses"]
        assert torch.equal(together[i], alone[0])


def test_sampling_is_reproducible_by_seed_and_top_k_1_is_greedy(rollout):
    prompts = prompts_of(rollout.tokenizer, ["Count: 1 2 3"]).repeat(4)
    sampled = SamplingParams(do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=6, seed=11)
    first = rollout.generate_sequences(prompts, sampled).batch["responses"]
    again = rollout.generate_sequences(prompts, sampled).batch["responses"]
    assert torch.equal(first, again)
    assert len({tuple(r.tolist()) for r in first}) > 1  # four samples of one prompt differ
    top1 = SamplingParams(do_sample=True, temperature=0.7, top_p=1.0, top_k=1, max_new_tokens=6, seed=3)
    greedy = rollout.generate_sequences(prompts, GREEDY).batch["responses"]
    assert torch.equal(rollout.generate_sequences(prompts, top1).batch["responses"], greedy)
