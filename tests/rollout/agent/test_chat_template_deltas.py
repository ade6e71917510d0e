"""Tool output is appended as the chat template's own tokens, and templates that are not append-only keep the
generated tokens as generated."""

import copy

import pytest
from agent_helpers import EOS, call, scripted_rollout
from rollout_helpers import greedy, prompts_of

from hybridflow.batch_keys import ATTENTION_MASK, RESPONSE_MASK, RESPONSES
from hybridflow.models import load_tokenizer
from hybridflow.rollout.agent.chat import ChatFormat, ChatTemplateError

# Like Qwen3's: an assistant message's reasoning (<think>...</think>) is dropped once any later message follows
# it, so re-rendering a conversation changes the tokens of its earlier turns.
DROPS_REASONING = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not loop.last and '</think>' in m['content'] -%}"
    "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1] + '<|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}"
)

# A template that marks an assistant message followed by a tool message: no delta can be appended to it.
REWRITES_CALLING_TURN = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{%- if m['role'] == 'assistant' and not loop.last %}{{ ' [called]' }}{% endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}"
)


def _with_template(template):
    tokenizer = copy.deepcopy(load_tokenizer("tiny-llama"))
    tokenizer.chat_template = template
    return tokenizer


def test_the_delta_is_what_the_template_puts_between_turns():
    tokenizer = load_tokenizer("tiny-llama")
    chat = ChatFormat(tokenizer, [tokenizer.eos_token_id])
    by_hand = "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    assert chat.tool_response_ids(["4", "ok"]) == tokenizer.encode(by_hand, add_special_tokens=False)
    chat = ChatFormat(tokenizer, [tokenizer.eos_token_id], tool_role="user")
    assert tokenizer.decode(chat.tool_response_ids(["4"])) == "\n<|im_start|>user\n4<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_keeps_the_generated_tokens():
    tokenizer = _with_template(DROPS_REASONING)
    turns = ["<think>2 plus 3, use the tool</think>" + call("calculator", '{"expression": "2+3"}') + EOS, "5" + EOS]
    rollout = scripted_rollout(tokenizer, {0: turns})
    prompts = prompts_of(tokenizer, ["What is 2+3?"])
    batch = rollout.generate_sequences(prompts, greedy(400))
    n = int(batch.batch[ATTENTION_MASK][0, -400:].sum())
    response = batch.batch[RESPONSES][0, :n].tolist()
    t1, t2 = (tokenizer.encode(t, add_special_tokens=False) for t in turns)
    delta = tokenizer.encode("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert response == t1 + delta + t2  # the reasoning the model generated is still there, token for token
    assert batch.batch[RESPONSE_MASK][0, :n].tolist() == [1] * len(t1) + [0] * len(delta) + [1] * len(t2)
    # re-rendering the conversation as text would have changed what the model saw
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": turns[0].removesuffix(EOS)},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    rerendered = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    assert rerendered[: len(prompt)] == prompt and rerendered[len(prompt) :] != response
    assert "think" not in tokenizer.decode(rerendered)


def test_a_template_that_changes_the_calling_turn_is_refused_with_the_reason():
    tokenizer = _with_template(REWRITES_CALLING_TURN)
    chat = ChatFormat(tokenizer, [tokenizer.eos_token_id])
    with pytest.raises(ChatTemplateError, match="renders the assistant turn differently"):
        chat.tool_response_ids(["5"])


def test_a_template_without_a_stop_token_after_assistant_turns_is_refused():
    tokenizer = load_tokenizer("tiny-llama")
    with pytest.raises(ChatTemplateError, match="cannot tell where a turn ends"):
        ChatFormat(tokenizer, [tokenizer.pad_token_id])
