"""Which text of a rendered conversation a model learns to write: its assistant turns, found through the chat template.

A conversation becomes one or more *samples*, each a list of text segments marked trained (an assistant turn,
through its end-of-turn token) or not (the system, user and tool messages, the template's headers, whatever the
template writes after an end token; an assistant message marked ``"train": false``, such as a worked example in
the prompt). Each trained assistant turn is placed where the template puts it at generation time:

    context = render(messages[:i], add_generation_prompt=True)   # what the model is given
    turn    = render(messages[:i + 1])                            # the same, with turn i written

``turn`` must start with ``context``; the trained text is what follows it, through the last end token. While each
context starts with the previous turn's rendering, the turns extend one sample, exactly as the agent loop
extends a trajectory (it never re-renders: rollout/agent/chat.py). A template that renders earlier turns
differently once more messages follow (Qwen3's drops the reasoning of earlier assistant turns, say) breaks that:
then a new sample starts, holding the re-rendered history as untrained context and the new turn as trained
text. Every assistant turn is trained once, in the context the model sees when it writes it, never in a
re-rendered form it never generates.

The segments are tokenised one by one (``tokenize_sample``), as at generation time: the context is tokenised
alone, and the model writes the turn's tokens after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> text
TRAIN_KEY = "train"  # an assistant message with "train": false is context (a worked example in the prompt, say)


class ChatMaskError(ValueError):
    """The chat template does not let the assistant turns of a conversation be found."""


@dataclass
class TextSample:
    """One training sequence: consecutive (text, trained) segments."""

    segments: list[tuple[str, bool]] = field(default_factory=list)


def _trained_end(turn: str, start: int, end_texts: Sequence[str]) -> int | None:
    """The index just after the last end token's text in ``turn[start:]`` (None: no end token there)."""
    ends = [turn.rfind(end, start) + len(end) for end in end_texts if end and turn.rfind(end, start) >= 0]
    return max(ends) if ends else None


def _check_tool_calls(message: dict[str, Any], written: str, index: int) -> None:
    """An assistant message's structured tool calls must appear in the text the template wrote for it."""
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        name = function.get("name") if isinstance(function, dict) else None
        if name and name not in written:
            raise ChatMaskError(
                f"message {index}: the chat template does not write the assistant's tool_calls (the call to "
                f"{name!r} is not in its text), so the model would not learn to call it; write the calls into the "
                "message's content in the format the agent loop parses (multi_turn.format, e.g. hermes "
                '<tool_call>{"name": ..., "arguments": {...}}</tool_call>), or use a template that renders tool_calls'
            )


def conversation_samples(messages: list[dict[str, Any]], render: Render, end_texts: Sequence[str]) -> list[TextSample]:
    """The samples of one conversation (see the module's docstring). ``end_texts``: the texts of the tokens that
    end an assistant turn (generation's stop tokens). ChatMaskError when a turn cannot be placed."""
    samples: list[TextSample] = []
    rendered = None  # the current sample's text so far, as the template wrote it (trailing template text included)
    trains = [message.get("role") == "assistant" and message.get(TRAIN_KEY, True) is not False for message in messages]
    messages = [{key: value for key, value in message.items() if key != TRAIN_KEY} for message in messages]
    for index, message in enumerate(messages):
        if not trains[index]:
            continue
        if index == 0:
            raise ChatMaskError("message 0 is an assistant message; a conversation starts with a system or user one")
        context = render(messages[:index], True)
        turn = render(messages[: index + 1], False)
        if not turn.startswith(context):
            raise ChatMaskError(
                f"message {index}: the chat template's text for the conversation through this assistant message "
                "does not start with its text for the conversation before it plus the generation prompt, so the "
                "assistant's tokens cannot be told from the template's; use a template whose generation prompt is "
                "the start of an assistant message"
            )
        end = _trained_end(turn, len(context), end_texts)
        if end is None:
            raise ChatMaskError(
                f"message {index}: the chat template ends this assistant message without an end token "
                f"({', '.join(map(repr, end_texts))}), so the model would not learn to stop; use a template that "
                "closes assistant messages with the tokenizer's end-of-turn token"
            )
        _check_tool_calls(message, turn[len(context) : end], index)
        if rendered is not None and context.startswith(rendered):
            sample = samples[-1]
            sample.segments.append((context[len(rendered) :], False))
        else:  # the first turn, or the template re-rendered the history: a new sample
            sample = TextSample([(context, False)])
            samples.append(sample)
        sample.segments.append((turn[len(context) : end], True))
        rendered = turn[:end]
    if not samples:
        raise ChatMaskError("the conversation has no assistant message to learn from (none, or all marked train false)")
    for sample in samples:  # the text a template writes after the last trained end token is not needed
        sample.segments = [(text, trained) for text, trained in sample.segments if text]
    return samples


def tokenize_sample(sample: TextSample, encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask: 1 on trained tokens), each segment tokenised on its own."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in sample.segments:
        piece = encode(text)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask
