"""The tokens a chat template inserts after an assistant turn: tool messages, then the next assistant header.

The loop never re-renders the conversation. It renders a fixed two-message conversation with and
without the tool messages appended, and takes what the second adds after the assistant turn's end
token (the one generation stopped on): exactly what the template would put there. Rendering only that
delta keeps templates that are not append-only correct (Qwen3's, say, drops the reasoning of earlier
assistant turns once a later user turn exists): the tokens the model generated stay as generated.
"""

from __future__ import annotations

from typing import Any

_BASE = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": "Answer."}]


class ChatTemplateError(ValueError):
    pass


class ChatFormat:
    """Token deltas of one tokenizer's chat template. end_token_ids: the tokens that end an assistant turn
    (the stop tokens of generation)."""

    def __init__(self, tokenizer: Any, end_token_ids: list[int], tool_role: str = "tool"):
        self.tokenizer = tokenizer
        self.tool_role = tool_role
        prefix = self._ids(_BASE, add_generation_prompt=False)
        ends = [i for i, token in enumerate(prefix) if token in end_token_ids]
        if not ends:
            raise ChatTemplateError(
                "the chat template does not end an assistant message with a stop token "
                f"({end_token_ids}); the agent loop cannot tell where a turn ends"
            )
        self.prefix = prefix[: ends[-1] + 1]  # through the assistant turn's end token

    def _ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tool_response_ids(self, contents: list[str]) -> list[int]:
        """The ids that follow an assistant turn's end token to add one tool message per content and open the
        next assistant turn."""
        messages = _BASE + [{"role": self.tool_role, "content": content} for content in contents]
        full = self._ids(messages, add_generation_prompt=True)
        if full[: len(self.prefix)] != self.prefix:
            raise ChatTemplateError(
                "the chat template renders the assistant turn differently once a tool message follows it, so "
                "tool output cannot be appended to the generated tokens; use a template that renders earlier "
                "turns the same way, or a tool_role it accepts"
            )
        return full[len(self.prefix) :]

    def truncate(self, text: str, max_tokens: int) -> str:
        """``text`` as is, or its first and last tokens, ``max_tokens`` in all, with the cut marked between them:
        a tool's output often ends with what matters most (a result, an error's last line)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text
        head = max_tokens // 2
        tail = max_tokens - head
        cut = len(ids) - max_tokens
        return f"{self.tokenizer.decode(ids[:head])}...({cut} tokens cut)...{self.tokenizer.decode(ids[-tail:])}"
