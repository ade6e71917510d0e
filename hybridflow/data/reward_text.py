"""What a reward model reads: the conversation, rendered by the reward model's own chat template, tokenised whole.

One rendering for both sides of a reward model's life, so that a model trained here scores in an RL run exactly as
it was trained: the RL reward worker (workers/reward_model.py) renders each prompt with the policy's decoded answer
as the last assistant message, and the reward-model data set (data/reward_pairs.py) renders each pair's answers the
same way. The model scores a sequence at its last token that is not the pad token (transformers'
``*ForSequenceClassification`` rule, models/loading.py ``load_reward_model``).
"""

from __future__ import annotations

from typing import Any


def scored_conversation(prompt: str | list[dict[str, Any]], answer: str | list[dict[str, Any]]) -> list[dict]:
    """The messages a reward model reads: the prompt's (text: one user message) then the answer's (text: one
    assistant message)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    answers = [{"role": "assistant", "content": answer}] if isinstance(answer, str) else list(answer)
    return [*messages, *answers]


def reward_model_text(tokenizer: Any, conversation: list[dict[str, Any]]) -> str:
    """``conversation`` rendered by the reward model's chat template, without a generation prompt."""
    return tokenizer.apply_chat_template(conversation, tokenize=False)


def reward_model_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids of a rendered text: tokenised whole, no special tokens added (the template wrote them)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
