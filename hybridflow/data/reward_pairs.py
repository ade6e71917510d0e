"""RewardPairDataset: preference pairs as the reward model reads them, for Bradley-Terry training (``hybridflow rm``).

Rows are PreferenceDataset's (a prompt with a chosen and a rejected answer, or two conversations sharing their first
messages; data/preference_dataset.py). Each answer becomes the text an RL run's reward worker would score
(data/reward_text.py): the conversation through the reward model's chat template, tokenised whole. So a model
trained on these rows scores a policy's answers in an RL run exactly as it scored them here.

Rows 2k and 2k+1 are pair k, chosen first. The two answers' shared first tokens are the row's "prompt" and the rest
its "response" (the RL step's layout, data/token_rows.py): a packed pass computes the shared part once for both,
and micro-batches keep a pair together. A text longer than ``data.max_length`` loses its first tokens under
``overlong=truncate``, as the reward worker's tokenizer cuts it.
"""

from __future__ import annotations

from typing import Any

from hybridflow.batch_keys import INDEX
from hybridflow.data.preference_dataset import (
    CHOSEN,
    MARGIN,
    REJECTED,
    PairDataset,
    pair_margin,
    pair_parts,
)
from hybridflow.data.reward_text import reward_model_ids, reward_model_text, scored_conversation
from hybridflow.data.token_rows import LOSS_MASK, PROMPT_IDS, RESPONSE_IDS, OverlongSample


def shared_tokens(first: list[int], second: list[int]) -> int:
    """How many tokens two sequences share from their start, leaving each at least one of its own."""
    limit = min(len(first), len(second)) - 1
    count = 0
    while count < limit and first[count] == second[count]:
        count += 1
    return count


class RewardPairDataset(PairDataset):
    """Pairs tokenised once, up front, by the reward model's tokenizer (``generation_eos`` is unused: a scored text
    ends where its template ends). A pair's rows hold as ``prompt_ids`` the tokens its two answers share, and the
    rest as ``response_ids``."""

    truncation = "keep the last tokens, as the RL reward worker does"

    def _pair(self, row: dict[str, Any], row_number: int) -> tuple[dict[str, Any] | None, int]:
        config = self.config
        prompt, chosen, rejected = pair_parts(row, config)
        margin = pair_margin(row, config.margin_key)
        ids = [self._ids(prompt, answer) for answer in (chosen, rejected)]
        longest = max(len(i) for i in ids)
        cut = 0
        if longest > config.max_length:
            if config.overlong == "error":
                raise OverlongSample(longest)
            if config.overlong == "drop":
                return None, 0
            cut = sum(len(i) > config.max_length for i in ids)
            ids = [i[-config.max_length :] for i in ids]
        shared = shared_tokens(*ids)
        chosen_row, rejected_row = (
            {
                PROMPT_IDS: i[:shared],
                RESPONSE_IDS: i[shared:],
                LOSS_MASK: [1] * (len(i) - shared),
                INDEX: row_number,
            }
            for i in ids
        )
        return {CHOSEN: chosen_row, REJECTED: rejected_row, MARGIN: margin}, cut

    def _ids(self, prompt: Any, answer: Any) -> list[int]:
        if not isinstance(prompt, str) and not isinstance(answer, str):
            if not any(m.get("role") == "assistant" for m in answer):
                raise ValueError("an answer has no assistant message (it is all of the shared prompt?)")
        text = reward_model_text(self.tokenizer, scored_conversation(prompt, answer))
        return reward_model_ids(self.tokenizer, text)

    def trained_tokens(self) -> int:
        """Tokens the model reads, both answers of every pair (it is scored at each answer's last one)."""
        return sum(
            len(pair[s][PROMPT_IDS]) + len(pair[s][RESPONSE_IDS]) for pair in self.pairs for s in (CHOSEN, REJECTED)
        )
