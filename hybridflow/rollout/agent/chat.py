"""The tokens a chat template inserts after an assistant turn: tool messages, then the next assistant header.

The loop never re-renders the conversation. It renders a fixed two-message conversation with and
without the tool messages appended, and takes what the second adds after the assistant turn's end
token (the one generation stopped on): exactly what the template would put there. Rendering only that
delta keeps templates that are not append-only correct (Qwen3's, say, drops the reasoning of earlier
assistant turns once a later user turn exists): the tokens the model generated stay as generated.

Tool text is data, never control: a tool's answer (the sandboxed code's output, say) that contains a special or
added token's text (``<|im_end|>``, ``<|im_start|>``, ``<tool_call>``, ...) must not become that token, or the tool
could end its message and forge turns of its own. The template is rendered with a placeholder for each content;
its own text is tokenised as usual (its control tokens recognised), and in the contents each occurrence of an
added token's text is tokenised as plain text. Where a content holds none, the ids are exactly those of
tokenising the whole rendered text. A check that the ids hold no control token the template did not put there
guards the rest (a content is then tokenised as plain text as a whole). The template sees placeholders, so a
template that transforms contents (trims them, say) is given them as they are.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

_BASE = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": "Answer."}]
_PLACEHOLDER = "HYBRIDFLOWTOOLCONTENT{}PLACEHOLDER"  # letters and digits: no template escapes or trims them


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
        added = tokenizer.added_tokens_decoder  # id -> AddedToken: the special tokens and the other added ones
        self.control_ids = frozenset(added)
        texts = sorted({token.content for token in added.values()}, key=len, reverse=True)  # longest match first
        self._control_text = re.compile("|".join(map(re.escape, texts))) if texts else None

    def _ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self._encode(text)

    def tool_response_ids(self, contents: list[str]) -> list[int]:
        """The ids that follow an assistant turn's end token to add one tool message per content and open the
        next assistant turn. No text of a content becomes a control token."""
        return self.continuation_ids([{"role": self.tool_role, "content": content} for content in contents])

    def continuation_ids(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """The ids that follow an assistant turn's end token to add ``messages`` (tool or user messages, each
        with a ``content`` string) and open the next assistant turn, as the template renders them after a
        conversation. No text of a content becomes a control token."""
        pieces, contents = self._template_pieces(_BASE, messages, template_kwargs)
        return self._ids_of(pieces, contents, skip=len(self.prefix))

    def conversation_ids(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """A whole conversation with the next assistant header, as the template renders it (``template_kwargs``:
        ``tools=...``, say), with every message's content tokenised as plain text: no text a client sent
        becomes a control token."""
        pieces, contents = self._template_pieces([], messages, template_kwargs)
        return self._ids_of(pieces, contents, skip=0)

    def _ids_of(self, pieces: list[str], contents: list[str], skip: int) -> list[int]:
        """The ids of the template's ``pieces`` with ``contents`` between them, after the first ``skip`` (which
        must be the base conversation's ``prefix``)."""
        template = self._encode("".join(pieces))[skip:]  # the template's own text, no contents
        template_controls = Counter(i for i in template if i in self.control_ids)
        for whole in (False, True):  # whole: each content as plain text as a whole, the guard's fallback
            full = self._encode_segments(pieces, contents, whole)
            if skip and full[:skip] != self.prefix:
                raise ChatTemplateError(
                    "the chat template renders the assistant turn differently once a message follows it, "
                    "so later messages cannot be appended to the generated tokens; use a template that renders "
                    "earlier turns the same way, or a tool_role it accepts"
                )
            delta = full[skip:]
            if Counter(i for i in delta if i in self.control_ids) == template_controls:
                return delta
        raise ChatTemplateError("message text would become control tokens of this tokenizer; this is a bug")

    def _template_pieces(
        self, fixed: list[dict[str, Any]], messages: list[dict[str, Any]], template_kwargs: dict[str, Any]
    ) -> tuple[list[str], list[str]]:
        """The rendered conversation (``fixed`` as they are, then ``messages``, then the next assistant header)
        cut at each of ``messages``' contents: n + 1 pieces of the template's own text, and the n contents."""
        marks = [_PLACEHOLDER.format(i) for i in range(len(messages))]
        marked = [{**message, "content": mark} for message, mark in zip(messages, marks)]
        text = self.tokenizer.apply_chat_template(
            fixed + marked, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        pieces = []
        for message, mark in zip(messages, marks):
            if text.count(mark) != 1:
                raise ChatTemplateError(
                    f"the chat template does not show a {message['role']!r} message's content once, as given; "
                    "its text cannot be placed in it"
                )
            piece, text = text.split(mark)
            pieces.append(piece)
        return [*pieces, text], [str(message.get("content") or "") for message in messages]

    def _encode_segments(self, pieces: list[str], contents: list[str], whole: bool) -> list[int]:
        """The template's pieces with the contents between them: runs of text tokenised as usual, and the
        contents' control-token texts (or, if ``whole``, the contents) tokenised as plain text."""
        segments: list[tuple[str, bool]] = []  # (text, plain)
        for piece, content in zip(pieces, contents, strict=False):
            segments.append((piece, False))
            segments += [(content, True)] if whole else self._split_controls(content)
        segments.append((pieces[-1], False))
        ids, run = [], ""
        for text, plain in segments:
            if plain:
                ids += self._encode(run) + self._plain_ids(text)
                run = ""
            else:
                run += text
        return ids + self._encode(run)

    def _split_controls(self, text: str) -> list[tuple[str, bool]]:
        """``text`` cut into (part, is a control token's text)."""
        if self._control_text is None:
            return [(text, False)]
        parts, start = [], 0
        for match in self._control_text.finditer(text):
            parts += [(text[start : match.start()], False), (match.group(), True)]
            start = match.end()
        return [*parts, (text[start:], False)]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _plain_ids(self, text: str) -> list[int]:
        """``text`` tokenised as text: special tokens are split as characters; where an added token that is not
        special still matches, the text is halved around it, so each half holds only part of its text."""
        if not text:
            return []
        ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        if not self.control_ids.intersection(ids):
            return ids
        if len(text) == 1:
            raise ChatTemplateError(f"the character {text!r} is a control token of this tokenizer")
        half = len(text) // 2
        return self._plain_ids(text[:half]) + self._plain_ids(text[half:])

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
